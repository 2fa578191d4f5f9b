"""Soak: the corridor task for many steps through the real gateway in async mode, with faults, watching
the trainer's resources and accounting for every dataset sample.

``agl train``'s run driver (:func:`agl_core.runs.train.run`) trains the reference torch backend in this
process, its in-process policy server registered behind a real ``agl-server``, agents spawned per
rollout by a real ``agl-controller`` (both from the gateway venv, on 127.0.0.1, stopped by PID).
Faults on a schedule:

- the gateway is killed (SIGKILL) and restarted on the same port every ``--restart-every`` steps,
  between two steps, while the next step's rollouts are in flight (async mode keeps them going);
- agents crash (the process exits after its first model call) and dawdle (sleep before starting) at
  fixed rates, chosen per rollout by a hash of its id (``benchmarks/soak_agent.py``);
- a hook raises in ``agl_on_succeeded`` on every ``--hook-raise-every``-th call.

The async staleness bound is on (``trainer.v1.sampler.max_off_policy_threshold``, ``--max-off-policy-threshold``,
default 2, and ``--max-off-policy-strategy``, default ``drop``), tight enough that the slow agents' groups
pass it: evicted groups (and their rollouts), the fresh groups that replaced them, the groups waited
for, and the largest span a step trained are reported, and checked against the bound.

Every ``--every`` steps it records the trainer's RSS, the bytes its C heap has handed out and not
taken back and the free bytes it keeps (glibc's ``mallinfo2``), Python's allocated blocks (RSS
growing while these stay flat is memory an allocator keeps, not a leak), open file descriptors and
threads, the number of rollouts the gateway holds (its ledger) and the run directory's size. The
benchmark's own bookkeeping stays small: step metrics are summed as they arrive, not kept per step.
At the end it prints that table, the growth per 100 steps after warm-up (a least-squares slope), and
the accounting: each group the trainer enqueued (one dataset row, ``rollout.n`` rollouts) was
trained, left out with one rollout left, had every rollout fail, or was still in flight when the run
ended; every rollout reached a terminal state the hooks saw; each epoch enqueued every row once.

Run: ``.venv/bin/python benchmarks/bench_soak.py [--steps 1000] [--every 20] [--out DIR]`` (a
1,000-step run took 47 minutes on 2 CPU cores shared with other work; run it at low priority). Interrupted with
Ctrl-C (SIGINT), it stops the gateway and controller and reports the steps that ran. ``tests/e2e/test_soak.py`` runs a
60-step version with the same checks.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from agl_core import hookimpl  # noqa: E402
from agl_core.plugins import DISABLE_AUTOLOAD_ENV  # noqa: E402
from agl_core.rollouts.gateway_client import GatewayClient, GatewayError  # noqa: E402
from agl_core.runs.train import run  # noqa: E402
from examples.corridor.build_policy import build  # noqa: E402
from tests.helpers.gateway_fixtures import list_rollouts  # noqa: E402
from tests.helpers.gateway_server import Controller, GatewayServer  # noqa: E402

CONFIG = REPO_ROOT / "examples" / "corridor" / "config.yaml"
DATASET = REPO_ROOT / "examples" / "corridor" / "dataset.jsonl"
MIB = 2**20
STATES = ("queuing", "running", "succeeded", "failed")
COLUMNS = ("step", "rss_mib", "heap_mib", "heap_free_mib", "py_blocks_k", "threads", "fds", "ledger", "run_dir_mib")
# Step metrics the accounting sums over the run (with the group counts).
SUMMED = (
    "training/rollouts/n_",
    "training/gateway/n_restarts",
    "training/n_hook_",
    "training/async/n_c",
    "training/n_sample",
    "training/off_policy/evicted_samples",
    "training/off_policy/n_",
)
# Step metrics whose largest value over the run is reported.
MAXED = ("training/off_policy/trained_staleness/max", "training/off_policy/evicted_samples_staleness/max")
GROUP_COUNTS = ("training/n_groups", "training/n_groups_dropped_one_rollout_left", "training/n_skipped_empty_rows")


@attrs.frozen
class Faults:
    restart_every: int = 100  # gateway killed and restarted after steps restart_every/2, 3*restart_every/2, ...
    crash_rate: float = 0.04  # agents that exit after their first model call
    slow_rate: float = 0.05  # agents that wait slow_seconds before starting
    slow_seconds: float = 3.0
    hook_raise_every: int = 25  # agl_on_succeeded raises on every n-th call
    max_off_policy_threshold: int | None = 2  # the async staleness bound (trainer.v1.sampler)
    max_off_policy_strategy: str = "drop"

    def agent_env(self) -> dict[str, str]:
        """The agents' fault rates (``benchmarks/soak_agent.py`` reads them from its environment)."""
        return {
            "SOAK_CRASH_RATE": str(self.crash_rate),
            "SOAK_SLOW_RATE": str(self.slow_rate),
            "SOAK_SLOW_SECONDS": str(self.slow_seconds),
        }

    def restart_after(self, step: int) -> bool:
        return self.restart_every > 0 and step % self.restart_every == self.restart_every // 2

    def describe(self) -> list[str]:
        return [
            f"gateway SIGKILLed and restarted (same port, all state lost) after every step s with "
            f"s % {self.restart_every} == "
            f"{self.restart_every // 2}, with the next step's rollouts in flight",
            f"{self.crash_rate:.0%} of agents exit (code 17) after their first model call",
            f"{self.slow_rate:.0%} of agents sleep {self.slow_seconds:g} s before starting",
            f"agl_on_succeeded raises on every {self.hook_raise_every}th call",
            f"staleness bound: max_off_policy_threshold {self.max_off_policy_threshold}, "
            f"strategy {self.max_off_policy_strategy}",
        ]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def heap_mib() -> dict[str, float]:
    """glibc malloc's bytes handed out and not given back, over all its arenas (``heap_mib``:
    ``uordblks``, plus ``hblkhd`` for blocks mapped on their own), and the free bytes it keeps in its
    arenas (``heap_free_mib``: ``fordblks``); NaN where ``mallinfo2`` is missing (not glibc 2.33+).
    Python's small objects live in its own arenas, outside these: ``py_blocks_k`` counts them."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return {"heap_mib": float("nan"), "heap_free_mib": float("nan")}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"heap_mib": (info.uordblks + info.hblkhd) / MIB, "heap_free_mib": info.fordblks / MIB}


def resources() -> dict[str, float]:
    """This process's resident memory, its C heap (:func:`heap_mib`), Python's allocated blocks, threads
    (the kernel's count, native threads included) and open fds."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {
        "rss_mib": int(status["VmRSS"].split()[0]) * 1024 / MIB,
        **heap_mib(),
        "py_blocks_k": sys.getallocatedblocks() / 1000,
        "threads": float(status["Threads"]),
        "fds": float(len(os.listdir("/proc/self/fd"))),
    }


def tree_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / MIB


class Soak:
    """The benchmark's plugin: the metric sink ``soak`` (records resources, injects the between-step
    faults) and lifecycle hooks that see every request and outcome (and raise on schedule)."""

    def __init__(self, gateway: GatewayServer, run_dir: Path, every: int, faults: Faults):
        self.gateway, self.run_dir, self.every, self.faults = gateway, run_dir, every, faults
        self.client = GatewayClient(gateway.url, gateway.key, timeout_seconds=5.0)
        self.lock = threading.Lock()
        self.table: list[dict[str, float]] = []
        self.n_steps = 0
        self.sums: Counter[str] = Counter()  # the SUMMED step metrics, over the run
        self.maxima: dict[str, float] = {}  # the MAXED step metrics, over the run
        self.last: dict[str, float] = {}  # the last step's metrics
        self.groups: dict[str, Any] = {}  # group id -> dataset row id, in enqueue order
        self.rollouts: dict[str, str] = {}  # rollout id -> group id
        self.outcomes: dict[str, str] = {}  # rollout id -> the terminal state the hooks saw
        self.n_succeeded_calls = 0
        self.n_raised = 0
        self.n_restarts = 0

    # -- the sink --------------------------------------------------------------------------------

    @hookimpl
    def agl_register_metric_sinks(self, register: Any) -> None:
        register("soak", lambda context: self)

    def log_samples(self, step: int, samples: Any) -> None:
        pass

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        if step <= 0:
            return
        self.n_steps += 1
        self.last = dict(metrics)
        for key, value in metrics.items():
            if key.startswith(SUMMED) or key in GROUP_COUNTS:
                self.sums[key] += value
            if key in MAXED:
                self.maxima[key] = max(self.maxima.get(key, value), value)
        if step == 1 or step % self.every == 0:
            self.table.append(
                {"step": float(step), **resources(), "ledger": self.ledger(), "run_dir_mib": tree_mib(self.run_dir)}
            )
            row = self.table[-1]
            with (self.run_dir.parent / "table.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"soak step {step}: rss {row['rss_mib']:.1f} MiB, heap {row['heap_mib']:.1f} MiB "
                f"(+{row['heap_free_mib']:.1f} free), python blocks {row['py_blocks_k']:.0f}k, "
                f"threads {row['threads']:g}, fds {row['fds']:g}, "
                f"ledger {row['ledger']:g}, run dir {row['run_dir_mib']:.2f} MiB, "
                f"reward {metrics.get('training/reward', float('nan')):.3f}",
                flush=True,
            )
        if self.faults.restart_after(step):
            self.gateway.restart()
            self.n_restarts += 1

    def close(self) -> None:
        self.client.close()

    def ledger(self) -> float:
        """Rollouts the gateway holds, in any state (the trainer deletes each one it has read)."""
        try:
            return float(len(list_rollouts(self.client, STATES, limit=100000)))
        except GatewayError:
            return float("nan")

    # -- the hooks ---------------------------------------------------------------------------------

    @hookimpl
    def agl_on_enqueue(self, request: Any) -> None:
        if request.is_train:
            with self.lock:
                self.groups.setdefault(request.group_id, request.input["id"])
                self.rollouts[request.rollout_id] = request.group_id

    @hookimpl
    def agl_on_succeeded(self, rollout: Any) -> None:
        with self.lock:
            self.outcomes[rollout.rollout_id] = "succeeded"
            self.n_succeeded_calls += 1
            if self.n_succeeded_calls % self.faults.hook_raise_every:
                return
            self.n_raised += 1
        raise RuntimeError("soak: this hook raises on schedule")

    @hookimpl
    def agl_on_failed(self, rollout: Any) -> None:
        with self.lock:
            self.outcomes[rollout.rollout_id] = "failed"


def growth_per_100_steps(table: Sequence[Mapping[str, float]], column: str, warmup: int) -> tuple[float, float]:
    """Least-squares slope of ``column`` per 100 steps over the rows after step ``warmup``, absolute
    and as a percentage of the column's mean there."""
    rows = [r for r in table if r["step"] > warmup and np.isfinite(r[column])]
    if len(rows) < 2:
        return float("nan"), float("nan")
    steps = np.array([r["step"] for r in rows])
    values = np.array([r[column] for r in rows])
    slope = float(np.polyfit(steps, values, 1)[0]) * 100
    mean = float(values.mean())
    return slope, (100 * slope / mean if mean else float("nan"))


def accounting(soak: Soak, n_rows: int, n: int) -> dict[str, Any]:
    """Where every enqueued group and rollout went (see the module docstring)."""
    per_group: dict[str, Counter[str]] = {g: Counter() for g in soak.groups}
    for rid, gid in soak.rollouts.items():
        per_group[gid][soak.outcomes.get(rid, "not terminal")] += 1
    kinds: Counter[str] = Counter()
    for counts in per_group.values():
        if counts["not terminal"]:
            kinds["in flight at the end"] += 1
        elif counts["succeeded"] >= 2 or (n == 1 and counts["succeeded"] == 1):
            kinds["complete (trainable)"] += 1
        elif counts["succeeded"] == 1:
            kinds["one rollout left (dropped)"] += 1
        else:
            kinds["every rollout failed"] += 1
    order = list(soak.groups.values())
    epochs = [order[i : i + n_rows] for i in range(0, len(order), n_rows)]
    sums, last = soak.sums, soak.last
    return {
        "groups_enqueued": len(per_group),
        "groups": dict(kinds),
        "groups_in_trained_batches": sums["training/n_groups"],
        "rows_collected": sums["training/n_sample_collected"],
        "rows_trained": sums["training/n_sample_trained"],
        "rows_dropped": {k.rsplit("/", 1)[1]: v for k, v in sums.items() if k.startswith("training/n_sample_dropped/")},
        "groups_carried_over_at_the_end": last.get("training/async/n_new_carry_over_rollouts", 0.0) / n,
        "rollouts_enqueued": len(soak.rollouts),
        "rollouts_by_outcome": dict(Counter(soak.outcomes.get(r, "not terminal") for r in soak.rollouts)),
        "epochs_with_every_row_once": sum(len(e) == n_rows and len(set(e)) == n_rows for e in epochs),
        "epochs_with_a_repeated_row": sum(len(set(e)) != len(e) for e in epochs),
        "partial_last_epoch_groups": len(epochs[-1]) if epochs and len(epochs[-1]) < n_rows else 0,
        "hook_raises_scheduled": soak.n_raised,
        "gateway_restarts_injected": soak.n_restarts,
        "off_policy": {
            "groups_evicted": sums["training/off_policy/evicted_samples"],
            "rollouts_evicted": sums["training/off_policy/n_evicted_rollouts"],
            "groups_refilled": sums["training/off_policy/n_refilled_groups"],
            "groups_waited_for": sums["training/off_policy/n_waited_groups"],
            "trained_span_max": soak.maxima.get(MAXED[0], 0.0),
            "evicted_span_max": soak.maxima.get(MAXED[1], 0.0),
        },
        "step_metric_sums": dict(sorted(sums.items())),
    }


def problems(
    report: Mapping[str, Any], batch: int = 2, n: int = 4, rss_tolerance: float = 0.01, faults: Faults = Faults()
) -> list[str]:
    """What the soak must show, as the list of what it did not: resources flat after warm-up (RSS
    growth under ``rss_tolerance`` per 100 steps, threads and fds within a few of their warm-up
    level), the gateway's ledger bounded, every fault survived and counted, every sample accounted for,
    and (``drop``) no group trained past the staleness bound, every evicted group counted with its rollouts."""
    found = []
    acc, sums = report["accounting"], report["accounting"]["step_metric_sums"]
    in_flight_cap = (batch + 1) * n  # async_train_batch_size groups in flight
    after = [r for r in report["table"] if r["step"] > report["warmup_steps"]]
    _, rss_percent = report["growth_per_100_steps"]["rss_mib"]
    if not rss_percent < 100 * rss_tolerance:
        found.append(f"RSS grows {rss_percent:.2f}% per 100 steps after warm-up (limit {100 * rss_tolerance:g}%)")
    for column, slack in (("threads", 6), ("fds", 16)):  # instantaneous counts: in-flight requests come and go
        values = [r[column] for r in after]
        if values and max(values) - min(values) > slack:
            found.append(f"{column} range from {min(values):g} to {max(values):g} after warm-up")
    if max((r["ledger"] for r in report["table"]), default=0) > 2 * in_flight_cap:
        found.append(
            f"the gateway held up to {max(r['ledger'] for r in report['table']):g} rollouts (bound {2 * in_flight_cap})"
        )
    if report["steps"] != report["steps_asked"]:
        found.append(f"{report['steps']} of {report['steps_asked']} steps ran")
    if (
        sums.get("training/gateway/n_restarts_detected", 0) < acc["gateway_restarts_injected"] - 1
    ):  # the last may follow the last step
        found.append(
            f"{acc['gateway_restarts_injected']} gateway restarts, "
            f"{sums.get('training/gateway/n_restarts_detected', 0):g} detected"
        )
    if sums.get("training/n_hook_failures", 0) != acc["hook_raises_scheduled"]:
        found.append(
            f"{acc['hook_raises_scheduled']} hook raises, "
            f"{sums.get('training/n_hook_failures', 0):g} hook failures counted"
        )
    outcomes = acc["rollouts_by_outcome"]
    if outcomes.get("failed", 0) != sums.get("training/rollouts/n_failed", 0):
        found.append(
            f"hooks saw {outcomes.get('failed', 0)} failed rollouts, "
            f"the trainer counted {sums.get('training/rollouts/n_failed', 0):g}"
        )
    if outcomes.get("not terminal", 0) > in_flight_cap:
        found.append(
            f"{outcomes['not terminal']} rollouts never reached a terminal state "
            f"(at most {in_flight_cap} may be in flight at the end)"
        )
    dropped = sum(acc["rows_dropped"].values()) + sums.get("training/n_skipped_empty_rows", 0)
    if acc["rows_collected"] != acc["rows_trained"] + dropped:
        found.append(
            f"{acc['rows_collected']:g} rows collected, {acc['rows_trained']:g} trained "
            f"+ {dropped:g} dropped or skipped"
        )
    if acc["epochs_with_a_repeated_row"]:
        found.append(f"{acc['epochs_with_a_repeated_row']} epochs enqueued a dataset row twice")
    off_policy, threshold = acc["off_policy"], faults.max_off_policy_threshold
    if threshold is not None and faults.max_off_policy_strategy == "drop":
        if off_policy["trained_span_max"] > threshold:
            found.append(
                f"a step trained a group spanning {off_policy['trained_span_max']:g} versions (bound {threshold})"
            )
        if off_policy["groups_evicted"] and off_policy["evicted_span_max"] <= threshold:
            found.append(
                f"groups spanning at most {off_policy['evicted_span_max']:g} versions were evicted (bound {threshold})"
            )
        if off_policy["rollouts_evicted"] != n * off_policy["groups_evicted"]:
            found.append(
                f"{off_policy['groups_evicted']:g} groups evicted with {off_policy['rollouts_evicted']:g} rollouts, "
                f"not {n} each"
            )
    return found


def soak(
    steps: int, every: int, out: Path, faults: Faults = Faults(), batch: int = 2, n: int = 4, pool: int = 8
) -> dict[str, Any]:
    """Run the soak; return its table, growth and accounting (also written to ``out/report.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    policy = build(out / "policy", seed=0)
    run_dir = out / "run"
    os.environ.update(faults.agent_env())  # the controller passes its environment to the agents
    os.environ[DISABLE_AUTOLOAD_ENV] = "1"  # agl's own plugins and this one only, whatever else is installed
    gateway = GatewayServer(key="soak-key", model_name=str(policy))
    controller = Controller(gateway, pool, log_path=out / "controller.log")
    started = time.monotonic()
    with gateway:
        controller.start()
        try:
            plugin = Soak(gateway, run_dir, every, faults)
            overrides = [
                f"agentlightning.agl_base_url={gateway.url}",
                f"agentlightning.agl_key={gateway.key}",
                "agentlightning.local.agent_class=benchmarks.soak_agent:SoakAgent",
                "agentlightning.async_rollout.enabled=true",
                f"agentlightning.async_rollout.async_train_batch_size={batch + 1}",
                "agentlightning.rollout_timeout_seconds=60",
                "agentlightning.rollout_timeout_grace_seconds=10",
                "agentlightning.gateway.liveness_check_seconds=2",
                f"actor_rollout_ref.model.path={policy}",
                f"data.train_files={DATASET}",
                f"data.train_batch_size={batch}",
                f"actor_rollout_ref.rollout.n={n}",
                f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
                f"trainer.total_training_steps={steps}",
                "trainer.save_freq=-1",
                "trainer.test_freq=-1",
                "trainer.val_before_train=false",
                "trainer.logger=[soak]",
                f"trainer.default_local_dir={run_dir}",
                "trainer.v1.sampler.max_off_policy_threshold="
                + ("null" if faults.max_off_policy_threshold is None else str(faults.max_off_policy_threshold)),
                f"trainer.v1.sampler.max_off_policy_strategy={faults.max_off_policy_strategy}",
            ]
            try:
                run(str(CONFIG), overrides, plugins=[plugin], show_progress=False)
            except KeyboardInterrupt:  # Ctrl-C (SIGINT): report the steps that ran
                print(f"soak: interrupted after step {plugin.n_steps}", flush=True)
        finally:
            controller.stop()
    n_rows = sum(1 for line in DATASET.read_text().splitlines() if line.strip())
    warmup = max(every, steps // 5)
    report = {
        "steps_asked": steps,
        "steps": plugin.n_steps,
        "wall_s": round(time.monotonic() - started, 1),
        "faults": faults.describe(),
        "table": plugin.table,
        "warmup_steps": warmup,
        "growth_per_100_steps": {c: growth_per_100_steps(plugin.table, c, warmup) for c in COLUMNS[1:]},
        "accounting": accounting(plugin, n_rows, n),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def print_report(report: Mapping[str, Any]) -> None:
    print(f"\nsoak: {report['steps']} steps in {report['wall_s']:.0f} s; faults:")
    for fault in report["faults"]:
        print(f"  - {fault}")
    print("\n| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for row in report["table"]:
        print(
            f"| {row['step']:.0f} | {row['rss_mib']:.1f} | {row['heap_mib']:.1f} | {row['heap_free_mib']:.1f} "
            f"| {row['py_blocks_k']:.0f} | {row['threads']:.0f} | {row['fds']:.0f} | {row['ledger']:.0f} "
            f"| {row['run_dir_mib']:.2f} |"
        )
    print(f"\ngrowth per 100 steps after step {report['warmup_steps']} (least-squares slope; % of the mean):")
    for column, (absolute, percent) in report["growth_per_100_steps"].items():
        print(f"  {column}: {absolute:+.3f} ({percent:+.2f}%)")
    print("\naccounting:")
    for key, value in report["accounting"].items():
        print(f"  {key}: {value}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=20, help="record resources every this many steps")
    parser.add_argument("--restart-every", type=int, default=Faults().restart_every)
    parser.add_argument("--hook-raise-every", type=int, default=Faults().hook_raise_every)
    parser.add_argument(
        "--max-off-policy-threshold",
        type=lambda v: None if v == "null" else int(v),
        default=Faults().max_off_policy_threshold,
        help="the async staleness bound (null: none)",
    )
    parser.add_argument("--max-off-policy-strategy", choices=("drop", "wait"), default=Faults().max_off_policy_strategy)
    parser.add_argument("--out", type=Path, default=None, help="work folder (default: a new temporary one)")
    args = parser.parse_args(argv)
    signal.signal(
        signal.SIGINT, signal.default_int_handler
    )  # also when started in the background, where SIGINT is ignored
    out = args.out or Path(tempfile.mkdtemp(prefix="agl-soak-"))
    faults = Faults(
        restart_every=args.restart_every,
        hook_raise_every=args.hook_raise_every,
        max_off_policy_threshold=args.max_off_policy_threshold,
        max_off_policy_strategy=args.max_off_policy_strategy,
    )
    report = soak(args.steps, args.every, out, faults)
    print_report(report)
    found = problems(report, faults=faults)
    print("\nchecks: " + ("all passed" if not found else "FAILED:\n  - " + "\n  - ".join(found)))
    print(f"report: {out / 'report.json'}")
    return 0 if not found else 1


if __name__ == "__main__":
    sys.exit(main())
