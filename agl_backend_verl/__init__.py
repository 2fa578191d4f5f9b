"""The verl backend for agl: verl's FSDP + vLLM training loop driven by agl's plugins.

Only this package imports verl.
"""
