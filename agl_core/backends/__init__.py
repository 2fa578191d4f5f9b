"""Training backends: the contract every backend keeps and the reference ``torch`` backend.

A backend may import stages, sources and serving modules; no backend imports another backend.
"""
