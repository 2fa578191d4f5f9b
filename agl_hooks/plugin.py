"""The ``hookfiles`` plugin (entry point of group ``agl``): loads the hook files a config names."""

from __future__ import annotations

from pathlib import Path

from agl_core import hookimpl
from agl_hooks.loader import load_hook_file

__all__ = ["agl_load_hook_file"]


@hookimpl
def agl_load_hook_file(path: Path) -> object:
    return load_hook_file(path)
