"""Start-up CPU time of ``agl plugins`` and ``agl check`` (torch backend), before and after, side by side.

Each command runs as a child process, ``--runs`` times per source tree, alternating between the
trees so that the machine's load falls on both alike; its CPU time is the child's user + system
time (``os.wait4``), which waiting on the disk or on other processes does not inflate the way it
does wall time. ``agl check`` checks ``examples/corridor/config.yaml`` with a corridor policy built
once into a temporary folder. The trees run under this interpreter with their own directory first on
``PYTHONPATH``, so both see the same installed packages and entry points (``agl_backend_verl.plugin``,
``agl_hooks.plugin`` and any other installed plugin load from the tree under test).

``--before`` is a source tree or a git revision of this repository (exported with ``git archive``);
``--after`` is a tree (default: this one).

    python benchmarks/bench_startup.py                       # main vs this working tree
    python benchmarks/bench_startup.py --before e4fd10a --runs 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = "examples/corridor/config.yaml"
# agl's own entry point, run as the installed ``agl`` script runs it.
AGL = "import sys; from agl_core.cli import main; sys.exit(main())"


def source_tree(spec: str, scratch: Path) -> Path:
    """``spec`` itself when it is a directory, else the git revision ``spec`` exported into ``scratch``."""
    if Path(spec).is_dir():
        return Path(spec).resolve()
    tree = scratch / f"tree-{spec.replace('/', '_')}"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", spec], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def cpu_seconds(command: list[str], tree: Path) -> tuple[float, float]:
    """``(cpu, wall)`` seconds of one run of ``command`` in ``tree``; a failing command stops the benchmark."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryFile() as stderr:
        started = time.perf_counter()
        child = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            stderr.seek(0)
            sys.exit(f"{' '.join(command[3:])} failed in {tree}:\n{stderr.read().decode()}")
    return usage.ru_utime + usage.ru_stime, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="main", help="source tree or git revision (default: main)")
    parser.add_argument("--after", default=str(REPO_ROOT), help="source tree (default: this one)")
    parser.add_argument("--runs", type=int, default=5, help="runs per command and tree (default: 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agl-bench-startup-") as scratch:
        trees = {"before": source_tree(args.before, Path(scratch)), "after": source_tree(args.after, Path(scratch))}
        policy = Path(scratch) / "policy"
        subprocess.run(
            [sys.executable, str(REPO_ROOT / "examples" / "corridor" / "build_policy.py"), str(policy)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        commands = {
            "agl plugins": ["plugins"],
            "agl check (torch)": ["check", CONFIG, f"actor_rollout_ref.model.path={policy}"],
        }
        times: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for name, command in commands.items():
            for _ in range(args.runs):
                for label, tree in trees.items():
                    run = cpu_seconds([sys.executable, "-c", AGL, *command], tree)
                    times.setdefault((name, label), []).append(run)
    print(f"start-up CPU time (user + sys of the child), seconds over {args.runs} runs each")
    print(f"before: {args.before}   after: {args.after}")
    print(f"{'command':<20} {'before min':>10} {'median':>8} {'after min':>10} {'median':>8} {'after/before':>13}")
    for name in commands:
        before = [cpu for cpu, _ in times[(name, "before")]]
        after = [cpu for cpu, _ in times[(name, "after")]]
        print(
            f"{name:<20} {min(before):>10.2f} {statistics.median(before):>8.2f} {min(after):>10.2f} "
            f"{statistics.median(after):>8.2f} {statistics.median(after) / statistics.median(before):>13.2f}"
        )
    print("wall-clock medians, for reference (they include the machine's load):")
    for name in commands:
        walls = {label: statistics.median(wall for _, wall in times[(name, label)]) for label in trees}
        print(f"  {name:<18} before {walls['before']:.2f} s, after {walls['after']:.2f} s")


if __name__ == "__main__":
    main()
