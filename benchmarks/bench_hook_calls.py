"""The per-rollout cost of the lifecycle hooks: ``agl_on_enqueue`` and ``agl_on_succeeded`` with 0, 1 and
10 plugins, as the plugin manager calls them (each implementation on its own, isolated and bounded by
``agentlightning.hook_timeout_seconds``).

Each plugin is a no-op (it returns at once), so what is measured is the manager's own cost per call:
microseconds per rollout for the enqueue chain and for the succeeded hooks, and the threads the
process started. The sides run one after the other, each in its own process: **before** is the
plugin manager as of ``--before`` (a git revision of this repository, extracted into a temporary
folder), **after** the working tree; the last column is after/before.

    python benchmarks/bench_hook_calls.py
    python benchmarks/bench_hook_calls.py --rollouts 5000 --before HEAD~3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_source import REPO_ROOT, extract  # noqa: E402

BEFORE = "902f1ac"  # a fresh daemon thread for every lifecycle call
PLUGIN_COUNTS = (0, 1, 10)


def run_side(n_rollouts: int) -> dict[str, Any]:
    """Per plugin count: microseconds per rollout of enqueue and of succeeded, and threads started."""
    from agl_core import CompletedRollout, EventWriter, PluginManager, RolloutRequest, hookimpl

    class NoOp:
        @hookimpl
        def agl_on_enqueue(self, request):
            return None

        @hookimpl
        def agl_on_succeeded(self, rollout, events, writer):
            return None

    started = [0]
    start = threading.Thread.start

    def counted_start(thread: threading.Thread) -> None:
        started[0] += 1
        start(thread)

    threading.Thread.start = counted_start  # type: ignore[method-assign]
    results = {}
    for count in PLUGIN_COUNTS:
        manager = PluginManager(load_entrypoints=False, builtins={})
        for _ in range(count):
            manager.register(NoOp())
        requests = [RolloutRequest(rollout_id=f"r{i}", group_id="g", input={"q": i}) for i in range(n_rollouts)]
        rollout = CompletedRollout(rollout_id="r0", group_id="g", state="succeeded")
        started[0] = 0
        t = time.perf_counter()
        for request in requests:
            manager.enqueue(request)
        enqueue = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(n_rollouts):
            manager.on_succeeded(rollout, {}, EventWriter())
        succeeded = time.perf_counter() - t
        results[str(count)] = {
            "enqueue_us": enqueue / n_rollouts * 1e6,
            "succeeded_us": succeeded / n_rollouts * 1e6,
            "threads_started": started[0],
        }
    return results


def side(tree: Path, n_rollouts: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--side-tree", str(tree), "--rollouts", str(n_rollouts)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"side {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--rollouts", type=int, default=2000, help="rollouts per measurement (default: 2000)")
    parser.add_argument("--before", default=BEFORE, help=f"git revision of the 'before' side (default: {BEFORE})")
    parser.add_argument("--side-tree", type=Path, help=argparse.SUPPRESS)  # one side, in its own process
    args = parser.parse_args()
    if args.side_tree:
        sys.path.insert(0, str(args.side_tree))
        print(json.dumps(run_side(args.rollouts)))
        return
    with tempfile.TemporaryDirectory(prefix="agl-bench-hooks-") as tmp:
        before = side(extract(args.before, Path(tmp) / "before"), args.rollouts)
    after = side(REPO_ROOT, args.rollouts)
    print(f"lifecycle hook calls per rollout, {args.rollouts} rollouts; before = {args.before}, after = working tree")
    print(f"{'plugins':>7} {'hook':>10} {'before us':>10} {'after us':>10} {'after/before':>13} {'threads b/a':>12}")
    for count in map(str, PLUGIN_COUNTS):
        for hook in ("enqueue", "succeeded"):
            b, a = before[count][f"{hook}_us"], after[count][f"{hook}_us"]
            threads = f"{before[count]['threads_started']}/{after[count]['threads_started']}"
            print(f"{count:>7} {hook:>10} {b:>10.1f} {a:>10.1f} {a / b if b else float('nan'):>13.2f} {threads:>12}")


if __name__ == "__main__":
    main()
