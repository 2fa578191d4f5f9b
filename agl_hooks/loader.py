"""Load user hook files (``.py`` paths) as agl plugins.

Two forms are accepted:

* module-level functions decorated with ``@agl_core.hookimpl`` and named after agl hooks
  (``agl_on_enqueue``, ``agl_register_aggregators``...): the module itself becomes the plugin;
* an Agent Lightning v1.0 hook file: exactly one subclass of ``RolloutHooks`` overriding
  ``on_startup / on_enqueue / on_succeeded / on_failed``: an instance is wrapped in
  :class:`~agl_hooks.rollout_hooks.RolloutHooksPlugin`. As v1.0's loader does, the subclass is looked
  for among all the module's attributes, so one imported from a helper module counts (while the
  file is imported, its directory is on ``sys.path``, so a helper beside it can be imported).

Every failure is a :class:`HookFileError` that names the file (a ``sys.exit`` while the file is
imported included).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import os
import sys
import traceback
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agl_core.plugins import PluginError
from agl_core.plugins.manager import KNOWN_HOOKS
from agl_core.suggestions import misspelling_of, suggest
from agl_hooks import rollout_hooks, schemas
from agl_hooks.rollout_hooks import HOOK_METHODS, RolloutHooksPlugin, is_rollout_hooks_base


class HookFileError(PluginError):
    """A hook file could not be loaded; the message names the file and what is wrong."""


@contextlib.contextmanager
def _agentlightning_alias() -> Iterator[None]:
    """Resolve ``agentlightning.hooks`` / ``agentlightning.schemas`` to agl's compatible API while a
    hook file executes, unless Agent Lightning itself is importable (its models are then the ones hooks
    receive: :func:`~agl_hooks.rollout_hooks.v1_models`)."""
    if rollout_hooks.v1_models() is not schemas:
        yield
        return
    package = types.ModuleType("agentlightning")
    package.__path__ = []  # type: ignore[attr-defined]
    package.hooks = rollout_hooks  # type: ignore[attr-defined]
    package.schemas = schemas  # type: ignore[attr-defined]
    aliases = {"agentlightning": package, "agentlightning.hooks": rollout_hooks, "agentlightning.schemas": schemas}
    saved = {name: sys.modules.get(name) for name in aliases}
    sys.modules.update(aliases)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@contextlib.contextmanager
def _on_sys_path(directory: Path) -> Iterator[None]:
    """``directory`` first on ``sys.path`` while a hook file executes, as a script's own directory is."""
    entry = str(directory)
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)


def _is_rollout_hooks_class(obj: Any) -> bool:
    if not inspect.isclass(obj):
        return False
    return not is_rollout_hooks_base(obj) and any(is_rollout_hooks_base(c) for c in obj.__mro__[1:])


def _exec_module(path: Path) -> types.ModuleType:
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    module_name = f"agl_hookfile_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise HookFileError(f"hook file {path} is not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        with _agentlightning_alias(), _on_sys_path(path.parent):
            spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(module_name, None)
        if isinstance(exc, KeyboardInterrupt):
            raise
        if isinstance(exc, SystemExit):
            raise HookFileError(
                f"hook file {path} called sys.exit({exc.code!r}) while being imported; a hook file may not exit"
            ) from None
        if isinstance(exc, SyntaxError) and exc.filename == str(path):
            raise HookFileError(
                f"hook file {path} failed to import: {path}:{exc.lineno}: SyntaxError: {exc.msg}"
            ) from None
        frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
        in_file = [f for f in frames if str(path) in f or not f.startswith("  File ")]
        raise HookFileError(f"hook file {path} failed to import:\n{''.join(in_file).rstrip()}") from exc
    return module


def load_hook_file(path: str | os.PathLike[str]) -> Any:
    """Import one hook file and return the plugin object to register."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise HookFileError(f"hook file not found: {path}")
    module = _exec_module(path)

    classes = list(dict.fromkeys(obj for _, obj in inspect.getmembers(module, _is_rollout_hooks_class)))
    functions = {
        attr: obj
        for attr, obj in vars(module).items()
        if attr.startswith("agl_") and callable(obj) and getattr(obj, "__module__", None) == module.__name__
    }
    for attr in functions:
        if attr not in KNOWN_HOOKS:
            raise HookFileError(f"hook file {path} defines unknown hook {attr!r}; {suggest(attr, KNOWN_HOOKS)}")
    for attr, obj in vars(module).items():
        meant = (
            misspelling_of(attr, KNOWN_HOOKS) if inspect.isfunction(obj) and obj.__module__ == module.__name__ else None
        )
        if meant is not None and attr not in functions:
            raise HookFileError(
                f"hook file {path}: function {attr} is not a hook, so it would never be called; did you mean {meant!r}?"
            )
    undecorated = [attr for attr, fn in functions.items() if not hasattr(fn, "agl_impl")]
    if undecorated:
        raise HookFileError(f"hook file {path}: {', '.join(undecorated)} must be decorated with @agl_core.hookimpl")

    if len(classes) > 1:
        names = ", ".join(sorted(cls.__name__ for cls in classes))
        raise HookFileError(
            f"hook file {path} holds several RolloutHooks subclasses ({names}) defined or imported; keep exactly one"
        )
    if classes and functions:
        raise HookFileError(
            f"hook file {path} mixes a RolloutHooks subclass ({classes[0].__name__}) with @hookimpl functions "
            f"({', '.join(functions)}); use one form per file"
        )
    if classes:
        cls = classes[0]
        for attr in vars(cls):
            if attr.startswith("on_") and attr not in HOOK_METHODS:
                raise HookFileError(
                    f"hook file {path}: {cls.__name__}.{attr} is not a hook; {suggest(attr, HOOK_METHODS)}"
                )
            if (meant := misspelling_of(attr, HOOK_METHODS)) is not None:
                raise HookFileError(
                    f"hook file {path}: {cls.__name__}.{attr} is not a hook, so it would never be called; "
                    f"did you mean {meant!r}?"
                )
        try:
            instance = cls()
        except Exception as exc:
            raise HookFileError(f"hook file {path}: {cls.__name__}() failed: {exc!r}") from exc
        return RolloutHooksPlugin(instance)
    if functions:
        return module
    raise HookFileError(
        f"no hooks found in hook file {path}: define @agl_core.hookimpl functions named after agl hooks "
        f"({', '.join(KNOWN_HOOKS)}) or one RolloutHooks subclass"
    )
