"""User hook files as agl plugins, and Agent Lightning v1.0's ``RolloutHooks`` kept source-compatible."""

from agl_hooks.loader import HookFileError, load_hook_file
from agl_hooks.rollout_hooks import RolloutHooks

__all__ = ["HookFileError", "RolloutHooks", "load_hook_file"]
