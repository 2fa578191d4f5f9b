"""The reference backend ``torch``: one process, PyTorch, any local causal LM (see :mod:`.backend`).

May import every ``agl_core`` stage, source and serving module; never another backend, never verl.
Importing the package imports nothing: ``agl check`` reads :mod:`.checks` without loading torch.
"""
