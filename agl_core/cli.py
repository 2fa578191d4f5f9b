"""The ``agl`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from agl_core.plugins import PluginManager


def _plugins(args: argparse.Namespace) -> int:
    manager = PluginManager.from_config({"agentlightning": {"hooks": args.hooks or None}})
    for info in manager.list_plugins():
        print(f"{info.name}  [{info.source}]")
        print(f"  hooks: {', '.join(info.hooks) or '-'}")
        for kind, names in sorted(info.provides.items()):
            print(f"  {kind}: {', '.join(names)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agl", description="Agent Lightning trainer side as a plugin system.")
    sub = parser.add_subparsers(dest="command", required=True)
    plugins = sub.add_parser("plugins", help="list registered plugins, their hooks and registry names")
    plugins.add_argument("--hooks", action="append", metavar="FILE", help="also load this hook file (repeatable)")
    plugins.set_defaults(func=_plugins)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except Exception as exc:  # a clear one-line error, not a traceback, for expected failures
        from agl_core.config import ConfigError
        from agl_core.plugins import PluginError
        from agl_core.registry import RegistryError
        from agl_hooks.loader import HookFileError

        if isinstance(exc, (ConfigError, PluginError, RegistryError, HookFileError)):
            print(f"agl: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
