"""Training backends: the contract every backend keeps (:mod:`agl_core.backends.contract`) and the
reference ``torch`` backend.

A backend may import stages, sources and serving modules; no backend imports another backend.
"""
