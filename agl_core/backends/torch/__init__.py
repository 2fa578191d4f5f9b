"""The reference backend ``torch``: one process, PyTorch, any local causal LM (see :mod:`.backend`).

May import every ``agl_core`` stage, source and serving module; never another backend, never verl.
"""

from agl_core.backends.torch.backend import TorchBackend

__all__ = ["TorchBackend"]
