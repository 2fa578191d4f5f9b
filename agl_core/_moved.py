"""Old module paths kept importable for one minor release, each use warning with the new import.

:data:`MOVED` is the one table: old module -> the modules its names live in now, searched in
order (a module that was split lists both parts). ``import agl_core`` puts :class:`MovedModules`
at the end of ``sys.meta_path``, so only a path that no longer exists is served by it: importing it
raises a :class:`DeprecationWarning` naming the new module, and each name read from it one naming
that name's new import (``from agl_core import X`` when ``X`` is part of the stable surface,
``agl_core.__all__``). A name that is gone is an ``AttributeError`` saying so.

Moving a module: add its row here in the same change, and a line under "Migration" in
``CHANGELOG.md``; the row is removed in :data:`REMOVED_IN`'s release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any

__all__ = ["MOVED", "REMOVED_IN", "MovedModules", "install", "new_import"]

#: the release in which the rows below stop working.
REMOVED_IN = "0.3.0"

#: old module -> its names' modules now, searched in order (layout v2 grouped agl_core by stage; the
#: built-ins then moved to agl_core/builtins/, and the gateway check of agl check to agl_core/rollouts/).
MOVED: dict[str, tuple[str, ...]] = {
    "agl_core.advantage": ("agl_core.stages.advantage", "agl_core.builtins.estimators"),
    "agl_core.aggregation": ("agl_core.stages.aggregation",),
    "agl_core.aggregators": ("agl_core.builtins.aggregators",),
    "agl_core.backends.preflight": ("agl_core.rollouts.gateway_check",),
    "agl_core.batch_shaping": ("agl_core.stages.shaping",),
    "agl_core.backends.torch.data_order": ("agl_core.backends.data_order",),
    "agl_core.checkpoint": ("agl_core.backends.torch.checkpoint", "agl_core.backends.checkpoints"),
    "agl_core.embedded": ("agl_core.rollouts.embedded", "agl_core.rollouts.agents"),
    "agl_core.event_writer": ("agl_core.plugins.event_writer",),
    "agl_core.events": ("agl_core.rollouts.events",),
    "agl_core.gateway_client": ("agl_core.rollouts.gateway_client",),
    "agl_core.gateway_source": ("agl_core.rollouts.gateway", "agl_core.rollouts.source"),
    "agl_core.inference_engine": ("agl_core.serving.engine",),
    "agl_core.losses": ("agl_core.stages.policy_loss", "agl_core.builtins.losses", "agl_backend_verl.policy_loss"),
    "agl_core.mismatch": ("agl_core.stages.mismatch",),
    "agl_core.normalization": ("agl_core.stages.normalization",),
    "agl_core.pipeline": ("agl_core.stages.pipeline",),
    "agl_core.policy_server": ("agl_core.serving.policy_server",),
    "agl_core.processes": ("agl_core.serving.processes",),
    "agl_core.registry": ("agl_core.plugins.registry",),
    "agl_core.rollout_source": ("agl_core.rollouts.source",),
    "agl_core.stages.estimators": ("agl_core.builtins.estimators",),
    "agl_core.stages.levels": ("agl_core.builtins.aggregators",),
    "agl_core.stages.losses": ("agl_core.builtins.losses",),
    "agl_core.tensorize": ("agl_core.stages.tensorize",),
    "agl_core.torch_backend": ("agl_core.backends.torch.backend",),
    "agl_core.tracking.builtins": ("agl_core.builtins.sinks",),
    "agl_core.vllm_engine": ("agl_core.serving.vllm_engine",),
}


def _stable(name: str) -> bool:
    return name in getattr(sys.modules.get("agl_core"), "__all__", ())


def new_import(old: str, name: str) -> tuple[str, Any]:
    """Where ``name`` of old module ``old`` is imported from now, and its value."""
    for module_name in MOVED[old]:
        module = importlib.import_module(module_name)
        if hasattr(module, name):
            home = "agl_core" if _stable(name) else module_name
            return home, getattr(module, name)
    raise AttributeError(
        f"{old}.{name} no longer exists ({old} moved to {' and '.join(MOVED[old])}, which have no {name!r}); see "
        "CHANGELOG.md, Migration"
    )


class _MovedModule(types.ModuleType):
    """An old module path: every name read from it is looked up in its new modules, with a warning."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        home, value = new_import(self.__name__, name)
        warnings.warn(
            f"{self.__name__}.{name} has moved: use 'from {home} import {name}' ({self.__name__} goes in agl "
            f"{REMOVED_IN})",
            DeprecationWarning,
            stacklevel=2,
        )
        return value

    def __dir__(self) -> list[str]:
        return sorted({n for m in MOVED[self.__name__] for n in getattr(importlib.import_module(m), "__all__", ())})


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The finder and loader of the old paths in :data:`MOVED`."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        """The old path's spec, located at its first new module's file, so the alias has the
        ``__file__`` code that walks modules (``inspect``, coverage, a plugin's own paths) reads."""
        if fullname not in MOVED:
            return None
        home = importlib.util.find_spec(MOVED[fullname][0])
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=home.origin if home is not None else None)
        spec.has_location = home is not None and home.has_location
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _MovedModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        warnings.warn(
            f"{module.__name__} has moved to {' and '.join(MOVED[module.__name__])}; import from there, or from "
            f"agl_core for the stable names ({module.__name__} goes in agl {REMOVED_IN}; see CHANGELOG.md, Migration)",
            DeprecationWarning,
            stacklevel=2,
        )


class _Package(types.ModuleType):
    """``agl_core`` itself: importing an old path named like a public name (``agl_core.tensorize``)
    binds the old module on the package, which would hide the public name; that binding is skipped."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, _MovedModule) and name in getattr(self, "__all__", ()):
            return
        super().__setattr__(name, value)


def install() -> None:
    """Serve the old paths (idempotent); after every real finder, so a module that exists wins."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
    package = sys.modules["agl_core"]
    if type(package) is types.ModuleType:
        package.__class__ = _Package
