"""The ``agl`` command line.

Every error ends the command with one ``agl: error:`` line (and, where it helps, one ``agl: hint:``
line) and exit status 2, never a traceback: errors agl expects (bad config, plugin, dataset, a
gateway or vLLM server that cannot be reached) say what is wrong; any other is reported as an
internal error, whose traceback ``--traceback`` shows.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.metadata
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from agl_core.errors import AglError, FileFormatError
from agl_core.plugins import PluginManager
from agl_core.scaffold import add_command as add_new_plugin_command

DISTRIBUTION = "agl-backend-verl"


class CommandError(AglError):
    """A command cannot do what it was asked (a missing or unreadable file...); the message says why."""


def _plugins(args: argparse.Namespace) -> int:
    manager = PluginManager.from_config({"agentlightning": {"hooks": args.hooks or None}})
    for info in manager.list_plugins():
        print(f"{info.name}  [{info.source}]" + ("  BROKEN" if info.error else ""))
        if info.error:
            print(f"  error: {info.error}")
            print(f"  (agl check and agl train refuse to run; block it with AGL_BLOCKED_PLUGINS={info.name})")
            continue
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


def _overrides(args: argparse.Namespace) -> list[str]:
    """The overrides, with the ``backend=NAME`` shorthand for ``agentlightning.backend=NAME``."""
    return [f"agentlightning.backend={o[len('backend=') :]}" if o.startswith("backend=") else o for o in args.overrides]


def _train(args: argparse.Namespace) -> int:
    from agl_core.runs.train import run

    dump_stacks_on_sigusr1()
    # under a launcher (torchrun), the processes other than rank 0 follow it and report nothing
    reports = int(os.environ.get("RANK", "0")) == 0
    run_dir = run(args.config, _overrides(args), show_progress=reports)
    if reports:
        written = run_contents(run_dir)
        print(f"agl: run finished; {written} in {run_dir}" if written else f"agl: run finished; nothing in {run_dir}")
    return 0


def run_contents(run_dir: Path) -> str:
    """What a run directory holds, in words: ``metrics``, ``plot``, ``checkpoints`` (verl's
    ``global_step_N`` folders, which the torch backend writes too), those present; ``""`` for none."""
    from agl_core.tracking.run_log import METRICS_FILE, PLOT_FILE

    present = [
        what
        for what, here in (
            ("metrics", (run_dir / METRICS_FILE).is_file()),
            ("plot", (run_dir / PLOT_FILE).is_file()),
            ("checkpoints", any(path.is_dir() for path in run_dir.glob("global_step_*"))),
        )
        if here
    ]
    return " and ".join(filter(None, [", ".join(present[:-1]), *present[-1:]]))


def _check(args: argparse.Namespace) -> int:
    """Everything ``agl train`` would check before training (its :func:`~agl_core.runs.preflight.preflight`),
    the backend's own check and the gateway, then the resolved config (secrets hidden)."""
    from agl_core.config import to_yaml
    from agl_core.rollouts.gateway_check import check_gateway
    from agl_core.runs.preflight import preflight
    from agl_core.runs.run_config import registered_backend, resolve_config

    config, manager = resolve_config(args.config, _overrides(args))
    checked = preflight(config, manager)
    report = [f"backend: {config.agentlightning.backend}"]
    report += [f"{kind}: {name} ({provider})" for kind, name, provider in checked.selected]
    report += [f"{key}: {n} rows" for key, n in checked.dataset_rows.items()]
    report.append(f"metric sinks: {', '.join(name for name, _ in checked.sinks)}")
    if config.agentlightning.local.env_map:
        report.append(
            "agentlightning.local.env_map: not checked against the rows, since agl_on_enqueue of "
            f"{', '.join(checked.enqueue_rewriters)} may rewrite them"
            if checked.enqueue_rewriters
            else "agentlightning.local.env_map: every field present in every row"
        )
    check_backend = registered_backend(manager, config.agentlightning.backend).check_config
    if check_backend is not None:
        check_backend(config)
        report.append(f"backend {config.agentlightning.backend!r}: its own checks passed")
    gateway = check_gateway(config)
    if gateway is not None:
        report.append(gateway)
    hook_files = [info.name for info in manager.list_plugins() if info.name.startswith("hookfile:")]
    report.append(f"hook files: {', '.join(hook_files) or 'none'}")
    print(to_yaml(config), end="")
    print("".join(f"# agl check: {line}\n" for line in report), end="")
    print("# agl check: passed; nothing was trained")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from agl_core.tracking.plot import plot_metrics
    from agl_core.tracking.run_log import METRICS_FILE, PLOT_FILE

    source = Path(args.run)
    metrics = source / METRICS_FILE if source.is_dir() else source
    if not metrics.is_file():
        raise CommandError(f"no metrics file at {metrics}")
    try:
        print(plot_metrics(metrics, args.output or metrics.with_name(PLOT_FILE)))
    except FileFormatError as exc:  # empty, or a line that is not a metrics record
        raise CommandError(f"cannot plot {metrics}: {exc}") from None
    return 0


def _replay(args: argparse.Namespace) -> int:
    """Re-run one recorded step of a run (its pipeline and its backend's update) and print its metrics."""
    import tempfile

    from agl_core.runs.replay import replay_step

    with tempfile.TemporaryDirectory(prefix="agl-replay-") as scratch:
        metrics = replay_step(args.run, args.step, _overrides(args), scratch)
    for name in sorted(metrics):
        print(f"{name}: {metrics[name]:.6g}")
    return 0


def package_version() -> str:
    """The installed distribution's version, else (running from a source tree) ``agl_core.__version__``."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        from agl_core import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agl", description="Agent Lightning trainer side as a plugin system.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument("--traceback", action="store_true", help="on an error, show the full traceback too")
    sub = parser.add_subparsers(dest="command", required=True)
    plugins = sub.add_parser("plugins", help="list registered plugins, their hooks and registry names")
    plugins.add_argument("--hooks", action="append", metavar="FILE", help="also load this hook file (repeatable)")
    plugins.set_defaults(func=_plugins)
    for name, func, text in (
        ("train", _train, "Train with the configured backend and plugins. kill -USR1 PID prints every thread's stack."),
        (
            "check",
            _check,
            "Check a run without training: resolve the config, load plugins and hook files, read the datasets "
            "(every field agentlightning.local.env_map names in every row), check the backend's requirements "
            "(model, devices, agent class), then print the resolved config with secrets hidden.",
        ),
    ):
        command = sub.add_parser(name, help=text.split(".")[0].split(":")[0].lower(), description=text)
        command.add_argument("config", help="YAML config file")
        command.add_argument(
            "overrides", nargs="*", metavar="key=value", help="config overrides (backend=NAME selects the backend)"
        )
        command.set_defaults(func=func)
    plot = sub.add_parser("plot", help="draw a run's metrics per step as a PNG")
    plot.add_argument("run", help="run directory (trainer.default_local_dir) or metrics.jsonl file")
    plot.add_argument("-o", "--output", help="PNG path (default: metrics.png beside the metrics)")
    plot.set_defaults(func=_plot)
    replay = sub.add_parser(
        "replay",
        help="re-run one recorded step of a run and print its metrics",
        description="Re-run step N of a run recorded with agentlightning.record_rollouts: its rollouts through the "
        "pipeline and the update of the backend the run used (backend=NAME picks another), from the run's checkpoint "
        "of step N-1 when there is one, else the initial model, with the run's config and these overrides (hook "
        "files, plugins' keys, the model's path...). A replayed step that trains nothing is an error.",
    )
    replay.add_argument("run", help="run directory holding rollouts.jsonl, or the recording itself")
    replay.add_argument("--step", type=int, required=True, help="the step to re-run")
    replay.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the recorded run's config")
    replay.set_defaults(func=_replay)
    add_new_plugin_command(sub)
    return parser


def _expected(exc: BaseException) -> tuple[bool, str | None]:
    """Whether agl expects ``exc`` (an :class:`~agl_core.errors.AglError`, or a file that is not
    there: its message is the explanation), and a hint to print with it."""
    if isinstance(exc, AglError):
        return True, exc.hint
    if isinstance(exc, FileNotFoundError):
        return True, None
    return False, "this looks like a bug in agl or a plugin; run again with --traceback to see where it happened"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse takes a command's key=value overrides only before its options (agl replay RUN --step N a=b)
    if extra and (getattr(args, "overrides", None) is None or any(e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return args.func(args)
    except BrokenPipeError:
        # The reader went away (``agl plugins | head``): nothing is wrong with agl. Its output goes
        # nowhere from here, so the interpreter's last flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:
        if args.traceback:
            raise
        expected, hint = _expected(exc)
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        message = lines[0] if len(lines) == 1 else f"{lines[0].rstrip(':')}: {lines[-1]}"  # a report's gist
        print(
            f"agl: error: {message if expected else f'internal error: {type(exc).__name__}: {message}'}",
            file=sys.stderr,
        )
        if hint is None and len(lines) > 1:
            hint = "run again with --traceback for the whole report"
        if hint:
            print(f"agl: hint: {hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
