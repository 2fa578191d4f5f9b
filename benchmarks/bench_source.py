"""The sync gateway source against a simulated gateway: from the last rollout's completion to tensors.

A simulated gateway (an ``httpx.MockTransport`` in the trainer's process, answering the routes the
source uses: create, terminal cursor, events, delete) holds ``R`` rollouts × ``T`` turns whose events
bodies are those of ``benchmarks/bench_vs_v1.py`` (``benchmarks/gateway_bodies.py``; 256×8: ~66 MB,
1,024×16: ~0.7 GB). Its rollouts turn terminal at random times spread over a window of seconds after
their creation (or all at once: a window of 0). The trainer side is ``GatewayRolloutSource.collect``
(default config, ``rollout.n = 8``), then what a training step runs on its rollouts before the
update: the step pipeline (``StepPipeline.prepare``: the trajectory aggregator, advantages, batch
shaping into mini-batches of 8 rows, so nearly every row is trained) and ``tensorize``, with the
source handing each rollout to the pipeline as it finishes where the side's revision does so. It
reports, per side:

- **tail**: wall seconds from the last rollout's completion to the tensors being ready (what the
  step waits for once its rollouts are done), how much of it passed before ``collect`` returned (the
  rest is the step pipeline and ``tensorize``), and the CPU seconds the trainer's process spent in it;
- **step CPU**: CPU seconds of the whole step in the trainer's process (reader threads included),
  and the tail's share of it;
- **peak RSS** of the side's process.

The sides run one after the other, each in its own process: **before** is the source as of
``--before`` (a git revision of this repository, extracted into a temporary folder), **after** the
working tree.

    nice -n 19 python benchmarks/bench_source.py          # 256x8 over 10 s and at once, 1024x16 over 30 s
    python benchmarks/bench_source.py --runs 256x8:5
"""

from __future__ import annotations

import argparse
import io
import json
import random
import resource
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
BEFORE = "87329aa"  # before each rollout was aggregated as it finished
RUNS = "256x8:10,256x8:0,1024x16:30"  # workload:window; window 0: every rollout finishes at once
N_PER_GROUP = 8


class SimulatedGateway:
    """The gateway routes the sync source calls, answered from the workload's bodies; rollout ``k``
    (in creation order) has body ``k`` and turns terminal ``delay[k]`` seconds after its creation."""

    def __init__(self, bodies: Any, window: float, seed: int = 0):
        rng = random.Random(seed)
        self.bodies = bodies
        self.delays = [rng.uniform(0.0, window) for _ in range(len(bodies))]
        self.index: dict[str, int] = {}
        self.done_at: list[tuple[float, str]] = []  # (monotonic completion time, rollout id), sorted

    def handle(self, request: Any) -> Any:
        import httpx

        path, now = request.url.path, time.monotonic()
        if request.method == "POST" and path == "/api/rollouts":
            created = json.loads(request.content)
            for item in created:
                self.index[item["rollout_id"]] = k = len(self.index)
                self.done_at.append((now + self.delays[k], item["rollout_id"]))
            self.done_at.sort()
            return httpx.Response(201, json=created)
        if path == "/api/rollouts/terminal":
            after, limit = int(request.url.params["after"]), int(request.url.params["limit"])
            terminal = sum(1 for at, _ in self.done_at if at <= now)
            items = [
                {"rollout_id": rid, "state": "succeeded"}
                for _, rid in self.done_at[after : min(terminal, after + limit)]
            ]
            return httpx.Response(
                200, json={"items": items, "next_after": after + len(items), "total_terminal": terminal}
            )
        rid = path.split("/")[3]
        if request.method == "DELETE":
            return httpx.Response(204)
        if path.endswith("/events"):
            return httpx.Response(
                200, content=self.bodies.get("raw", self.index[rid]), headers={"content-type": "application/json"}
            )
        return httpx.Response(404, json={"detail": "Rollout not found"})

    @property
    def last_completion(self) -> float:
        return self.done_at[-1][0]


def run_side(folder: Path, window: float) -> dict[str, Any]:
    """One step of the agl first on ``sys.path`` against the simulated gateway."""
    import httpx
    import torch
    from gateway_bodies import Bodies

    from agl_core.config import load_config
    from agl_core.plugins import PluginManager
    from agl_core.rollouts.gateway_client import GatewayClient
    from agl_core.rollouts.gateway_sync import GatewayRolloutSource
    from agl_core.stages.pipeline import StepPipeline
    from agl_core.stages.tensorize import tensorize

    torch.set_num_threads(1)
    bodies = Bodies(folder)
    gateway = SimulatedGateway(bodies, window)
    samples = [{"i": i} for i in range(len(bodies) // N_PER_GROUP)]
    config = load_config(
        overrides=[
            "agentlightning.agl_base_url=http://gateway.invalid",
            "actor_rollout_ref.model.path=policy",
            f"actor_rollout_ref.rollout.n={N_PER_GROUP}",
            "agentlightning.rollout_timeout_seconds=3600",
            # rows kept whole, in mini-batches of one group's rows: nearly every row is trained
            f"agentlightning.trace_aggregator.trajectory_max_prompt_length={1 << 30}",
            f"agentlightning.trace_aggregator.trajectory_max_response_length={1 << 30}",
            f"data.train_batch_size={len(samples)}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        ]
    )
    client = GatewayClient("http://gateway.invalid", transport=httpx.MockTransport(gateway.handle))
    source = GatewayRolloutSource(config, PluginManager(load_entrypoints=False, builtins={}), client)
    pipeline = StepPipeline(config, PluginManager(load_entrypoints=False))
    if hasattr(pipeline, "prepare_rollout"):  # a revision that aggregates each rollout as it finishes
        source.on_rollout_done = pipeline.prepare_rollout
    cpu = time.process_time()
    at_last_completion: list[float] = []  # the process's CPU time then, taken by a thread waiting for it

    def watch() -> None:
        while not gateway.done_at:  # the rollouts are created as collect starts
            time.sleep(0.01)
        time.sleep(max(0.0, gateway.last_completion - time.monotonic()))
        at_last_completion.append(time.process_time())

    threading.Thread(target=watch, daemon=True).start()
    batch = source.collect(samples, step=1, is_train=True)
    collected = time.monotonic()
    tensors = tensorize(pipeline.prepare(batch.rollouts, step=1).shaped.rows).tensors
    ready, cpu_ready = time.monotonic(), time.process_time()
    source.close()
    return {
        "tail": ready - gateway.last_completion,
        "collected": collected - gateway.last_completion,
        "cpu": cpu_ready - cpu,
        "tail_cpu": cpu_ready - at_last_completion[0],
        "rollouts": len(batch.rollouts),
        "rows": int(tensors["input_ids"].shape[0]),
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def extract(revision: str, into: Path) -> Path:
    """The repository's packages as of ``revision``, in ``into``."""
    packages = ["agl_core", "agl_hooks", "agl_backend_verl"]
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", revision, *packages], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def side(tree: Path, folder: Path, window: float) -> dict[str, Any]:
    command = [sys.executable, __file__, "--side-tree", str(tree), "--folder", str(folder), "--window", str(window)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"side {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs", default=RUNS, help="comma-separated WORKLOAD:WINDOW, completions spread over WINDOW seconds"
    )
    parser.add_argument("--window", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--before", default=BEFORE, help="git revision of the 'before' source")
    parser.add_argument("--side-tree", type=Path, help=argparse.SUPPRESS)  # one side, in its own process
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side_tree:
        sys.path[:0] = [str(args.side_tree), str(Path(__file__).parent)]
        print(json.dumps(run_side(args.folder, args.window)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from gateway_bodies import WORKLOADS, Bodies

    with tempfile.TemporaryDirectory(prefix="agl-bench-source-") as tmp:
        before = extract(args.before, Path(tmp) / "before")
        written: dict[str, Bodies] = {}
        for run in args.runs.split(","):
            name, window_text = run.split(":")
            n_rollouts, n_turns = WORKLOADS[name]
            window = float(window_text)
            folder = Path(tmp) / name
            if name not in written:
                folder.mkdir()
                written[name] = Bodies.write(folder, n_rollouts, n_turns, None)
            spread = f"completions over {window:g} s" if window else "every rollout finishing at once"
            print(
                f"\n== {name}: {n_rollouts} rollouts x {n_turns} turns, {written[name].meta['raw_bytes'] / 1e6:.0f} MB "
                f"of events, {spread}"
            )
            print(
                f"    {'':24} {'tail s':>7} {'of it: collect':>15} {'tail CPU s':>11} {'step CPU s':>11} "
                f"{'tail/step CPU':>14} {'rows':>5} {'peak RSS MB':>12}"
            )
            results = {}
            for label, tree in ((f"before ({args.before})", before), ("after (working tree)", REPO_ROOT)):
                r = results[label] = side(tree, folder, window)
                print(
                    f"    {label:24} {r['tail']:7.3f} {r['collected']:15.3f} {r['tail_cpu']:11.3f} {r['cpu']:11.3f} "
                    f"{r['tail_cpu'] / r['cpu']:14.1%} {r['rows']:5d} {r['peak_mb']:12.0f}"
                )
            first, second = results.values()
            print(
                f"    tail {first['tail'] / second['tail']:.1f}x shorter, step CPU {first['cpu'] / second['cpu']:.1f}x "
                "less"
            )


if __name__ == "__main__":
    main()
