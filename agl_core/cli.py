"""The ``agl`` command line."""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
from collections.abc import Sequence

from agl_core.plugins import PluginManager
from agl_core.scaffold import add_command as add_new_plugin_command


def _plugins(args: argparse.Namespace) -> int:
    manager = PluginManager.from_config({"agentlightning": {"hooks": args.hooks or None}})
    for info in manager.list_plugins():
        print(f"{info.name}  [{info.source}]")
        print(f"  hooks: {', '.join(info.hooks) or '-'}")
        for kind, names in sorted(info.provides.items()):
            print(f"  {kind}: {', '.join(names)}")
    return 0


def dump_stacks_on_sigusr1() -> bool:
    """Make ``kill -USR1 PID`` print every thread's stack to the process's stderr, for runs that seem
    stuck. False where there is no SIGUSR1 or no stderr file descriptor to write to."""
    stderr = sys.__stderr__
    if not hasattr(signal, "SIGUSR1") or stderr is None:
        return False
    try:
        faulthandler.register(signal.SIGUSR1, file=stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both OSError and ValueError
        return False
    return True


def _train(args: argparse.Namespace) -> int:
    from agl_core.train import run

    dump_stacks_on_sigusr1()
    overrides = [f"agentlightning.backend={o[len('backend='):]}" if o.startswith("backend=") else o for o in args.overrides]
    run_dir = run(args.config, overrides)
    print(f"agl: run finished; metrics, plot and checkpoints in {run_dir}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from agl_core.plot import plot_metrics
    from agl_core.train import METRICS_FILE, PLOT_FILE

    source = Path(args.run)
    metrics = source / METRICS_FILE if source.is_dir() else source
    if not metrics.is_file():
        raise FileNotFoundError(f"no metrics file at {metrics}")
    print(plot_metrics(metrics, args.output or metrics.with_name(PLOT_FILE)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agl", description="Agent Lightning trainer side as a plugin system.")
    sub = parser.add_subparsers(dest="command", required=True)
    plugins = sub.add_parser("plugins", help="list registered plugins, their hooks and registry names")
    plugins.add_argument("--hooks", action="append", metavar="FILE", help="also load this hook file (repeatable)")
    plugins.set_defaults(func=_plugins)
    train = sub.add_parser(
        "train",
        help="train with the configured backend and plugins",
        description="Train with the configured backend and plugins. kill -USR1 PID prints every thread's stack.",
    )
    train.add_argument("config", help="YAML config file")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (backend=NAME selects the backend)")
    train.set_defaults(func=_train)
    plot = sub.add_parser("plot", help="draw a run's metrics per step as a PNG")
    plot.add_argument("run", help="run directory (trainer.default_local_dir) or metrics.jsonl file")
    plot.add_argument("-o", "--output", help="PNG path (default: metrics.png beside the metrics)")
    plot.set_defaults(func=_plot)
    add_new_plugin_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except Exception as exc:  # a clear one-line error, not a traceback, for expected failures
        from agl_core.config import ConfigError
        from agl_core.plugins import PluginError, RegistryError

        if isinstance(exc, (ConfigError, PluginError, RegistryError, FileNotFoundError)):
            print(f"agl: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
