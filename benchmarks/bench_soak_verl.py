"""Soak of the verl backend: the corridor task for many steps through the real gateway in verl's
CPU mode (``colocate_async``), with ``bench_soak``'s faults and a trainer killed and resumed.

``agl train … backend=verl`` runs as a subprocess in its own process group (``tests/helpers/verl_e2e.py``'s
``Train``: ``examples/corridor/run_verl.sh`` with ``agl_backend_verl.cpu.CPU_KEYS``), against a real
``agl-server`` and ``agl-controller`` (``Stack``), with Ray in its own temp dir. Faults:

- the gateway is SIGKILLed and restarted on the same port once the benchmark reads a step ``s``
  with ``Faults.restart_after(s)`` in ``metrics.jsonl`` (the next step's rollouts in flight);
- agents crash and dawdle (``benchmarks/soak_agent.py``), ``agl_on_succeeded`` raises on schedule
  (``benchmarks/soak_hooks.py``);
- once step ``--kill-after`` is reported and checkpointed (``trainer.save_freq``), the whole
  ``agl train`` process group (the driver and Ray's services) is SIGKILLed with the next step's
  rollouts in flight; Ray's workers, each in a session of its own, exit with their raylet, and any
  process of the run still alive 30 s later is killed by PID and reported. ``agl train`` then runs
  again on the same run directory and resumes from that checkpoint (the second segment).

Every ``--every`` steps, and at each segment's first, it samples /proc: the RSS of the ``agl train``
driver, the summed RSS of the Ray worker processes under it (command line ``ray::…``: the task
runner, verl's ranks, the replica's server, verl's request load balancer and reward worker,
TransferQueue, idle workers) and of Ray's own services (gcs, raylet, the dashboard and its agents),
the gateway's ledger and the run directory's size. The accounting compares, per segment, what the
hooks saw (rollouts enqueued, succeeded, failed, lost to a restart and re-enqueued, in flight at the
end; hook raises) with the trainer's step metrics summed (``training/rollouts/n_*``,
``training/n_hook_failures``). A step's counts are reported with the step, so what happens after a
segment's last reported step (in the step that was killed, or while a finished run shuts down) is the
hooks' only.

Run: ``nice -n 10 .venv/bin/python benchmarks/bench_soak_verl.py [--steps 200] [--kill-after 100]
[--out DIR]``. Interrupted with Ctrl-C (SIGINT), it stops the run, gateway and controller, and
reports the steps that ran.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from agl_backend_verl.cpu import CPU_KEYS  # noqa: E402
from agl_core.plugins import DISABLE_AUTOLOAD_ENV  # noqa: E402
from agl_core.rollouts.gateway_client import GatewayClient, GatewayError  # noqa: E402
from benchmarks.bench_soak import MIB, STATES, Faults, growth_per_100_steps, tree_mib  # noqa: E402
from benchmarks.soak_hooks import RECORDS  # noqa: E402
from examples.corridor.build_policy import build  # noqa: E402
from tests.helpers.gateway_fixtures import list_rollouts  # noqa: E402
from tests.helpers.verl_e2e import Stack, Train, rows  # noqa: E402

HOOK_FILE = REPO_ROOT / "benchmarks" / "soak_hooks.py"
COLUMNS = ("step", "driver_rss_mib", "workers_rss_mib", "n_workers", "ray_services_rss_mib", "ledger", "run_dir_mib")
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
TRAINER_COUNTS = (
    "training/rollouts/n_created",
    "training/rollouts/n_reenqueued",
    "training/rollouts/n_succeeded",
    "training/rollouts/n_failed",
    "training/rollouts/n_timed_out",
    "training/rollouts/n_lost",
    "training/n_hook_failures",
    "training/gateway/n_restarts_detected",
    "training/async/n_resumed_groups",
    "training/async/n_recreated_groups",
    "training/off_policy/evicted_samples",
)


def run_keys(steps: int, batch: int, n: int, save_freq: int, faults: Faults, ray_tmp: str) -> list[str]:
    """The run's keys after ``run_verl.sh``'s and the CPU keys: a short colocate_async step."""
    threshold = "null" if faults.max_off_policy_threshold is None else str(faults.max_off_policy_threshold)
    return [
        *CPU_KEYS,
        f"agentlightning.hooks=[{HOOK_FILE}]",
        "agentlightning.local.agent_class=benchmarks.soak_agent:SoakAgent",
        "agentlightning.async_rollout.enabled=true",
        f"agentlightning.async_rollout.async_train_batch_size={2 * batch}",
        "agentlightning.gateway.pause_retry_after_seconds=1",
        "agentlightning.gateway.liveness_check_seconds=2",
        "agentlightning.rollout_timeout_seconds=60",
        "agentlightning.rollout_timeout_grace_seconds=10",
        f"data.train_batch_size={batch}",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",  # n rows, one per rank on the 2 CPU ranks
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        f"trainer.total_training_steps={steps}",
        f"trainer.save_freq={save_freq}",
        "trainer.max_actor_ckpt_to_keep=1",
        f"trainer.v1.sampler.max_off_policy_threshold={threshold}",
        f"trainer.v1.sampler.max_off_policy_strategy={faults.max_off_policy_strategy}",
        f"ray_kwargs.ray_init._temp_dir={ray_tmp}",
    ]


def processes() -> dict[int, tuple[int, int, str]]:
    """Every process: pid -> (parent pid, start time in ticks, command line)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            found[int(entry.name)] = (int(fields[1]), int(fields[19]), cmdline.strip())
    return found


def descendants(root: int) -> dict[int, tuple[int, str]]:
    """The processes under ``root`` (Ray's services are the driver's children, its workers the
    raylet's): pid -> (start time, command line)."""
    table = processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = table[pid][1:]
        todo += children.get(pid, [])
    return found


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / MIB
    except OSError:
        pass
    return 0.0


def is_worker(cmdline: str) -> bool:
    """A Ray worker process (actor or idle), not one of Ray's agents, which are titled ``ray::`` too."""
    return cmdline.startswith("ray::") and not cmdline.startswith(RAY_AGENTS)


class Segment:
    """One ``agl train`` run of the soak, watched until it ends or is killed."""

    def __init__(self, stack: Stack, run_dir: Path, name: str, keys: Sequence[str], steps: int):
        self.train = Train(stack, run_dir, steps, keys, name=name)
        self.name, self.run_dir = name, run_dir
        self.tree: dict[int, tuple[int, str]] = {}  # every process of the run seen so far
        self.sampled = False  # its first step is sampled too

    def sample(self, step: int, ledger: float) -> dict[str, float]:
        tree = descendants(self.train.process.pid)
        self.tree.update(tree)
        self.sampled = True
        workers = [pid for pid, (_, cmd) in tree.items() if is_worker(cmd)]
        services = [pid for pid in tree if pid not in workers]
        return {
            "step": float(step),
            "driver_rss_mib": rss_mib(self.train.process.pid),
            "workers_rss_mib": sum(map(rss_mib, workers)),
            "n_workers": float(len(workers)),
            "ray_services_rss_mib": sum(map(rss_mib, services)),
            "ledger": ledger,
            "run_dir_mib": tree_mib(self.run_dir),
        }

    def kill(self) -> list[str]:
        """SIGKILL the process group; then any process of the run that outlived it, by PID: the
        command lines of those."""
        self.train.stop()
        deadline, survivors = time.monotonic() + 30, []
        while time.monotonic() < deadline:
            alive = processes()
            survivors = [pid for pid, (start, _) in self.tree.items() if alive.get(pid, (0, -1))[1] == start]
            if not survivors:
                return []
            time.sleep(1)
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
        return [self.tree[pid][1][:80] for pid in survivors]


class Soak:
    """Runs the segments, injects the gateway restarts and samples the table."""

    def __init__(self, stack: Stack, run_dir: Path, every: int, faults: Faults, out: Path):
        self.stack, self.run_dir, self.every, self.faults, self.out = stack, run_dir, every, faults, out
        self.client = GatewayClient(stack.gateway.url, stack.gateway.key, timeout_seconds=5.0)
        self.table: list[dict[str, float]] = []
        self.seen: set[int] = set()
        self.n_restarts = 0
        self.survivors: list[str] = []

    def ledger(self) -> float:
        try:
            return float(len(list_rollouts(self.client, STATES, limit=100000)))
        except GatewayError:
            return float("nan")

    def watch(self, segment: Segment, kill_after: int | None, timeout: float) -> None:
        """Follow ``metrics.jsonl`` until the run exits (or, with ``kill_after``, kill it once that
        step is reported and checkpointed)."""
        marker = self.run_dir / "latest_checkpointed_iteration.txt"
        deadline = time.monotonic() + timeout
        while True:
            for step in [r["step"] for r in rows(self.run_dir) if r.get("step", 0) > 0 and r["step"] not in self.seen]:
                self.seen.add(step)
                if step % self.every == 0 or not segment.sampled:
                    self.table.append(segment.sample(step, self.ledger()))
                    with (self.out / "table.jsonl").open("a") as f:
                        f.write(json.dumps(self.table[-1]) + "\n")
                    print(f"soak {segment.name} step {step}: {self.table[-1]}", flush=True)
                if self.faults.restart_after(step):
                    self.stack.gateway.restart()
                    self.n_restarts += 1
            checkpointed = marker.is_file() and int(marker.read_text().strip() or 0)
            if kill_after is not None and kill_after in self.seen and checkpointed and checkpointed >= kill_after:
                self.survivors += segment.kill()
                print(f"soak: {segment.name} killed after step {kill_after}", flush=True)
                return
            if segment.train.process.poll() is not None:
                if segment.train.process.returncode:
                    raise RuntimeError(f"{segment.name} exited with {segment.train.process.returncode}")
                return
            if time.monotonic() > deadline:
                segment.kill()
                raise RuntimeError(f"{segment.name} did not finish within {timeout:g}s")
            time.sleep(0.2)


def hook_segments(run_dir: Path) -> list[list[dict[str, Any]]]:
    """The hook records, one list per ``agl train`` run (each opens with ``startup``)."""
    segments: list[list[dict[str, Any]]] = []
    path = run_dir / RECORDS
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if record["event"] == "startup":
            segments.append([])
        if segments:
            segments[-1].append(record)
    return segments


def hook_counts(records: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Each rollout the hooks saw enqueued, by where it ended: succeeded, failed, lost to a gateway
    restart (a later enqueue names it as replaced), or still in flight when the segment ended."""
    enqueued = [r for r in records if r["event"] == "enqueue"]
    replaced = {r["replaces"] for r in enqueued if r["replaces"]}
    outcomes = {r["rollout"]: r["event"] for r in records if r["event"] in ("succeeded", "failed")}
    states = Counter(outcomes.get(r["rollout"], "lost" if r["rollout"] in replaced else "in flight") for r in enqueued)
    return {
        "enqueued": len(enqueued),
        "succeeded": states["succeeded"],
        "failed": states["failed"],
        "lost and re-enqueued": states["lost"],
        "in flight at the end": states["in flight"],
        "terminal, not enqueued in this segment": len(set(outcomes) - {r["rollout"] for r in enqueued}),
        "hook raises": sum(1 for r in records if r["event"] == "raised"),
    }


def trainer_counts(step_rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    return {key: sum(r.get(key, 0) or 0 for r in step_rows) for key in TRAINER_COUNTS}


def accounting(run_dir: Path, kill_after: int | None) -> dict[str, Any]:
    """Hooks and trainer, per segment and in total."""
    steps = [r for r in rows(run_dir) if r.get("step", 0) > 0]
    bounds = [(0, kill_after), (kill_after, None)] if kill_after else [(0, None)]
    per = {}
    for i, (records, (low, high)) in enumerate(zip(hook_segments(run_dir), bounds), 1):
        mine = [r for r in steps if r["step"] > low and (high is None or r["step"] <= high)]
        span = f"steps {mine[0]['step']}-{mine[-1]['step']}" if mine else "no step"
        per[f"segment {i} ({span})"] = {"hooks": hook_counts(records), "trainer": trainer_counts(mine)}
    every = [r for segment in hook_segments(run_dir) for r in segment]
    return {
        "segments": per,
        "total": {"hooks": hook_counts(every), "trainer": trainer_counts(steps)},
        "steps_reported": [r["step"] for r in steps],
    }


def soak(
    steps: int,
    every: int,
    out: Path,
    faults: Faults = Faults(),
    kill_after: int | None = None,
    batch: int = 2,
    n: int = 2,
    timeout: float = 7200.0,
) -> dict[str, Any]:
    """Run the soak; return its table, growth and accounting (also written to ``out/report.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    policy = build(out / "policy", seed=0)
    run_dir = out / "run"
    # the controller passes its environment to the agents, Ray its own to the trainer actor's hook file
    os.environ.update(faults.agent_env(), SOAK_HOOK_RAISE_EVERY=str(faults.hook_raise_every))
    os.environ[DISABLE_AUTOLOAD_ENV] = "1"
    save_freq = kill_after or steps
    keys = run_keys(steps, batch, n, save_freq, faults, tempfile.mkdtemp(prefix="aglsk", dir="/tmp"))
    started = time.monotonic()
    names = ["killed", "resumed"] if kill_after else ["run"]
    with Stack(policy, out) as stack:
        watcher = Soak(stack, run_dir, every, faults, out)
        try:
            for name in names:
                segment = Segment(stack, run_dir, name, keys, steps)
                try:
                    watcher.watch(segment, kill_after if name == "killed" else None, timeout)
                finally:
                    watcher.survivors += segment.kill()
        except (KeyboardInterrupt, RuntimeError) as stopped:  # Ctrl-C (SIGINT), a failed run: report the steps that ran
            print(f"soak: stopped after {len(watcher.seen)} steps: {stopped!r}", flush=True)
        watcher.client.close()
    warmup = max(every, steps // 5)
    report = {
        "steps_asked": steps,
        "steps": len(watcher.seen),
        "wall_s": round(time.monotonic() - started, 1),
        "faults": [*faults.describe(), f"agl train's process group SIGKILLed after step {kill_after}, then resumed"]
        if kill_after
        else faults.describe(),
        "gateway_restarts_injected": watcher.n_restarts,
        "in_flight_window": 2 * batch * n,  # async_train_batch_size groups of rollout.n
        "processes_outliving_the_kill": watcher.survivors,
        "table": watcher.table,
        "warmup_steps": warmup,
        "growth_per_100_steps": {c: growth_per_100_steps(watcher.table, c, warmup) for c in COLUMNS[1:]},
        "accounting": accounting(run_dir, kill_after),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def problems(report: Mapping[str, Any]) -> list[str]:
    """Where hooks and trainer disagree, as a list: per segment the same rollouts enqueued, succeeded,
    failed and lost, the hook raises counted as hook failures (the hooks may count more, by at most
    the rollouts kept in flight: what happened after the segment's last reported step, in the killed
    step or while a finished run shut down); every step reported once; nothing of the killed run
    left running."""
    found = []
    acc = report["accounting"]
    for title, counts in acc["segments"].items():
        hooks, trainer, slack = counts["hooks"], counts["trainer"], report["in_flight_window"]
        pairs = (
            ("enqueued", "training/rollouts/n_created"),
            ("succeeded", "training/rollouts/n_succeeded"),
            ("failed", "training/rollouts/n_failed"),
            ("lost and re-enqueued", "training/rollouts/n_lost"),
            ("lost and re-enqueued", "training/rollouts/n_reenqueued"),
            ("hook raises", "training/n_hook_failures"),
        )
        found += [
            f"{title}: hooks {k} {hooks[k]}, trainer {m} {trainer[m]:g}"
            for k, m in pairs
            if not 0 <= hooks[k] - trainer[m] <= slack
        ]
        if hooks["terminal, not enqueued in this segment"]:
            found.append(f"{title}: {hooks['terminal, not enqueued in this segment']} rollouts ended unseen enqueued")
    steps = acc["steps_reported"]
    if sorted(steps) != list(range(1, report["steps_asked"] + 1)):
        found.append(f"{len(steps)} steps reported ({len(set(steps))} distinct), {report['steps_asked']} asked")
    if report["processes_outliving_the_kill"]:
        found.append(f"processes outlived the kill: {report['processes_outliving_the_kill']}")
    return found


def print_report(report: Mapping[str, Any]) -> None:
    print(f"\nsoak (verl): {report['steps']} steps in {report['wall_s']:.0f} s; faults:")
    for fault in report["faults"]:
        print(f"  - {fault}")
    print(f"gateway restarts injected: {report['gateway_restarts_injected']}")
    print(f"processes that outlived the kill: {report['processes_outliving_the_kill'] or 'none'}")
    print("\n| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for row in report["table"]:
        print(
            "| "
            + " | ".join(f"{row[c]:.0f}" if c in ("step", "n_workers") else f"{row[c]:.1f}" for c in COLUMNS)
            + " |"
        )
    print(f"\ngrowth per 100 steps after step {report['warmup_steps']} (least-squares slope; % of the mean):")
    for column, (absolute, percent) in report["growth_per_100_steps"].items():
        print(f"  {column}: {absolute:+.3f} ({percent:+.2f}%)")
    print("\naccounting (hooks' records; trainer's step metrics summed):")
    acc = report["accounting"]
    for title, counts in [*acc["segments"].items(), ("total", acc["total"])]:
        print(f"  {title}:\n    hooks: {counts['hooks']}\n    trainer: {counts['trainer']}")
    print(f"  steps reported: {len(acc['steps_reported'])}, distinct {len(set(acc['steps_reported']))}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20, help="record resources every this many steps")
    parser.add_argument("--kill-after", type=int, default=100, help="kill and resume after this step (0: never)")
    parser.add_argument("--restart-every", type=int, default=50)
    parser.add_argument("--hook-raise-every", type=int, default=Faults().hook_raise_every)
    parser.add_argument("--out", type=Path, default=None, help="work folder (default: a new temporary one)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also in the background, where SIGINT is ignored
    out = args.out or Path(tempfile.mkdtemp(prefix="agl-soak-verl-"))
    faults = Faults(restart_every=args.restart_every, hook_raise_every=args.hook_raise_every)
    report = soak(args.steps, args.every, out, faults, kill_after=args.kill_after or None)
    print_report(report)
    found = problems(report)
    print("\nchecks: " + ("all passed" if not found else "FAILED:\n  - " + "\n  - ".join(found)))
    print(f"report: {out / 'report.json'}")
    return 0 if not found else 1


if __name__ == "__main__":
    sys.exit(main())
