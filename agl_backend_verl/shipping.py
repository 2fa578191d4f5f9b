"""What a run ships to its Ray processes on every node: agl, its plugins and its hook files.

A node of the cluster is not assumed to hold any of them: only Python, verl, torch and Ray (the
driver's versions) must be installed on every node. :func:`shipped_runtime_env` adds to the job's
Ray runtime env (given to ``ray.init`` when agl starts or joins Ray):

- ``py_modules``: agl's packages and the top-level package of every plugin the run loads from an
  entry point in group ``agl``, as the driver imports them, each distribution with its metadata (a
  ``*.dist-info`` folder holding its ``METADATA`` and ``entry_points.txt``): Ray puts them first on
  every worker's path, so ``importlib.metadata`` finds the entry points (``agl`` and
  ``verl.plugins``) on any node, and the code that runs is the driver's;
- the run's hook files (``agentlightning.hooks``), each with the ``.py`` files beside it (helpers a
  hook file imports), as one package; the task runner loads those copies
  (:func:`localized_hook_files`), whatever the node's files are;
- ``env_vars``: where those copies are (:data:`HOOK_FILES_ENV`), and the replica server's bind and
  advertise hosts (:mod:`agl_backend_verl.replica_address`).

Plugin settings (``AGL_PLUGIN_SETTINGS``) travel in the same runtime env
(:mod:`agl_backend_verl.verl_plugins`). Ray ships local
packages only in the job's runtime env, not an actor's: a Ray started elsewhere must have been
given :func:`shipped_runtime_env` by whoever started it.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from importlib.metadata import Distribution, EntryPoint, entry_points
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from agl_backend_verl.replica_address import replica_hosts_env
from agl_core import PluginManager

HOOK_FILES_ENV = "AGL_SHIPPED_HOOK_FILES"
ENTRYPOINT_GROUP = "agl"
AGL_PACKAGES = ("agl_core", "agl_hooks", "agl_backend_verl")
METADATA_FILES = ("METADATA", "entry_points.txt")

__all__ = ["HOOK_FILES_ENV", "PATH_KEYS", "absolute_paths", "localized_hook_files", "shipped_runtime_env"]


def _top_level(module: str) -> str:
    return module.split(".", 1)[0]


def _module_path(name: str) -> Path:
    """Where top-level module ``name`` is imported from: its package folder or its ``.py`` file."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ModuleNotFoundError(f"module {name!r} is not importable here, so it cannot be shipped")
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    assert spec.origin is not None
    return Path(spec.origin)


def loaded_entry_points() -> list[EntryPoint]:
    """The entry points in group ``agl`` that a plugin manager of this process loads (autoload,
    blocked plugins and broken ones considered), agl's own included."""
    loaded = {info.name for info in PluginManager().list_plugins() if info.source.startswith("entry point")}
    return [ep for ep in entry_points(group=ENTRYPOINT_GROUP) if ep.name in loaded]


def _write_metadata(dist: Distribution, stage: Path) -> Path:
    """A ``NAME-VERSION.dist-info`` folder in ``stage`` with ``dist``'s metadata and entry points."""
    name, version = dist.metadata["Name"], dist.version
    folder = stage / f"{name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir(parents=True, exist_ok=True)
    for file in METADATA_FILES:
        text = dist.read_text(file)
        if text is not None:
            (folder / file).write_text(text)
    return folder


def _hook_file_paths(config: DictConfig) -> list[str]:
    hooks = OmegaConf.select(config, "agentlightning.hooks", default=None)
    if not hooks:
        return []
    return [str(hooks)] if isinstance(hooks, str) else [str(path) for path in hooks]


def _bundle_hook_files(paths: Iterable[str], stage: Path) -> tuple[Path, dict[str, str]]:
    """The hook files at ``paths`` and the ``.py`` files beside each, copied into one package in
    ``stage``; the package and, for each path as written, its copy's path inside the package."""
    resolved = {path: Path(path).expanduser().resolve() for path in paths}
    digest = hashlib.sha256("\n".join(str(p) for p in resolved.values()).encode()).hexdigest()[:12]
    package = stage / f"agl_hook_files_{digest}"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    folders: dict[Path, str] = {}
    copies: dict[str, str] = {}
    for written, path in resolved.items():
        if not path.is_file():
            continue  # the driver's plugin manager has refused it already, naming the key and the file
        if path.parent not in folders:
            folders[path.parent] = f"f{len(folders)}"
            target = package / folders[path.parent]
            target.mkdir()
            for source in path.parent.glob("*.py"):
                shutil.copy2(source, target / source.name)
        copies[written] = f"{folders[path.parent]}/{path.name}"
    return package, copies


def shipped_runtime_env(config: DictConfig, runtime_env: Mapping[str, Any]) -> dict[str, Any]:
    """``runtime_env`` with agl, the run's entry-point plugins and hook files added (module docstring)."""
    stage = Path(tempfile.mkdtemp(prefix="agl-shipped-"))
    eps = loaded_entry_points()
    modules = {*AGL_PACKAGES, *(_top_level(ep.module) for ep in eps)}
    dists = {ep.dist.metadata["Name"]: ep.dist for ep in eps if ep.dist is not None}
    py_modules = [str(_module_path(name)) for name in sorted(modules)]
    py_modules += [str(_write_metadata(dist, stage / "metadata")) for _, dist in sorted(dists.items())]
    env = dict(runtime_env)
    env_vars = {**(env.get("env_vars") or {}), **replica_hosts_env(config)}
    hook_files = _hook_file_paths(config)
    if hook_files:
        package, copies = _bundle_hook_files(hook_files, stage / "hooks")
        py_modules.append(str(package))
        env_vars[HOOK_FILES_ENV] = json.dumps({"package": package.name, "files": copies}, sort_keys=True)
    env["py_modules"] = [*(env.get("py_modules") or []), *py_modules]
    env["env_vars"] = env_vars
    return env


# The config's local paths that Ray processes open: the task runner and verl's workers run in Ray's
# working directory, which is not the directory of agl train on a cluster started elsewhere.
PATH_KEYS = (
    "data.train_files",
    "data.val_files",
    "agentlightning.replay",
    "trainer.default_local_dir",
    "actor_rollout_ref.model.path",
)


def absolute_paths(config: DictConfig) -> DictConfig:
    """``config`` with each relative path of :data:`PATH_KEYS` made absolute against this process's
    working directory (the model path only where it names a local folder: else it is a hub id)."""
    config = copy.deepcopy(config)
    for key in PATH_KEYS:
        value = OmegaConf.select(config, key, default=None)
        if key == "actor_rollout_ref.model.path" and not (isinstance(value, str) and Path(value).exists()):
            continue
        if isinstance(value, str) and value:
            OmegaConf.update(config, key, _absolute(value), force_add=False)
        elif OmegaConf.is_list(value):
            OmegaConf.update(config, key, [_absolute(str(path)) for path in value], force_add=False)
    return config


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().absolute()) if "://" not in path else path


def localized_hook_files(config: DictConfig) -> DictConfig:
    """``config`` with each hook file the driver shipped replaced by its copy on this node (a no-op
    where nothing was shipped, as in the driver)."""
    shipped = os.environ.get(HOOK_FILES_ENV)
    if not shipped:
        return config
    manifest = json.loads(shipped)
    folder = _module_path(manifest["package"])
    copies = {written: str(folder / copy) for written, copy in manifest["files"].items()}
    hooks = [copies.get(path, path) for path in _hook_file_paths(config)]
    with open_dict(config.agentlightning):
        config.agentlightning.hooks = hooks
    return config
