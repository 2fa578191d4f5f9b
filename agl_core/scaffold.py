"""``agl new-plugin NAME [--dir DIR]``: write a plugin package that passes its tests out of the box.

The package (``DIR/NAME``, ``src/`` layout) has a ``pyproject.toml`` with an ``agl`` entry point,
one module that declares typed settings, registers an aggregator, an advantage estimator and a
policy loss under the plugin's name and implements a lifecycle hook, and tests that run agl's
contract suites on each part and train two real steps with the harness
(:mod:`agl_core.testing.harness`). The files are rendered from the templates in
``agl_core/plugin_template/``.
"""

from __future__ import annotations

import argparse
import re
import string
from importlib.resources import files
from pathlib import Path

from agl_core.errors import AglError

__all__ = ["ScaffoldError", "add_command", "new_plugin"]

# target path (relative to the package folder) -> template file; ``{package}`` is the import name.
FILES = {
    "pyproject.toml": "pyproject.toml.tmpl",
    "README.md": "README.md.tmpl",
    "src/{package}/__init__.py": "package.py.tmpl",
    "tests/test_contracts.py": "test_contracts.py.tmpl",
    "tests/test_training.py": "test_training.py.tmpl",
}
_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")


class ScaffoldError(AglError, ValueError):
    """The plugin cannot be written: a bad name, a name agl already uses, or an existing folder."""


def _builtin_names() -> set[str]:
    from agl_core.plugins import PluginManager

    manager = PluginManager(load_entrypoints=False)
    registries = (manager.aggregators, manager.advantage_estimators, manager.policy_losses, manager.backends)
    return {name for registry in registries for name in registry.names()} | {
        info.name for info in manager.list_plugins()
    }


def new_plugin(name: str, directory: str | Path = ".") -> Path:
    """Write the plugin package ``name`` in ``directory/name``; return that folder.

    ``name`` is lower case letters and digits, words joined by ``-`` or ``_``: the distribution is
    ``name`` with ``-``, the import package and the registry names ``name`` with ``_``.
    """
    if not _NAME.match(name):
        raise ScaffoldError(
            f"plugin name {name!r} must be lower-case letters and digits, words joined by '-' or '_' (e.g. my-judge)"
        )
    package = name.replace("-", "_")
    if package in _builtin_names():
        raise ScaffoldError(f"plugin name {name!r} is taken by an agl built-in; choose another")
    target = Path(directory) / name
    if target.exists():
        raise ScaffoldError(f"{target} already exists; choose another name or --dir")
    values = {"package": package, "dist": package.replace("_", "-")}
    templates = files("agl_core") / "plugin_template"
    for relative, template in FILES.items():
        path = target / relative.format(package=package)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            string.Template((templates / template).read_text(encoding="utf-8")).substitute(values), encoding="utf-8"
        )
    return target


def _run(args: argparse.Namespace) -> int:
    target = new_plugin(args.name, args.dir)
    print(f"agl: wrote plugin {args.name!r} in {target}; next: pip install -e '{target}[test]' && pytest {target}")
    return 0


def add_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``new-plugin`` on the ``agl`` command line."""
    parser = subparsers.add_parser("new-plugin", help="write a new plugin package (entry point, stubs, tests)")
    parser.add_argument("name", help="the plugin's name, e.g. my-judge (distribution my-judge, package my_judge)")
    parser.add_argument("--dir", default=".", help="where to create the package folder NAME (default: here)")
    parser.set_defaults(func=_run)
