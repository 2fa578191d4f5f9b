"""The verl backend end to end through ``examples/corridor/run_verl.sh``: the real gateway and
``agl-controller runner_type=local`` on 127.0.0.1, ``agl train`` with backend ``verl``, Ray, verl's
workers and replicas. :func:`scenario` is the check: 2 sync steps, then async steps 3 and 4 resumed
from verl's step-2 checkpoint, the run killed once step 3 is checkpointed and resumed from it (its
groups in flight restored). ``tests/verl/test_two_nodes_e2e.py`` runs it in verl's CPU mode
(:data:`agl_backend_verl.cpu.CPU_KEYS`) on two nodes; ``scripts/gpu_check.py`` runs it with the GPU
keys of ``run_verl.sh`` (vLLM). The stack, :class:`Run` and the row checks serve any backend's
``agl train`` through the gateway (``tests/trl/test_trl_real_stack.py`` runs backend ``trl`` with them).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tests.helpers.gateway_server import REPO_ROOT, Controller, GatewayServer

RUN_VERL = REPO_ROOT / "examples" / "corridor" / "run_verl.sh"
BATCH, N = 2, 4  # groups per step, rollouts per group
POOL = 4  # agents at once: fewer than a step's rollouts, so async groups carry over
SECRET = "verl-e2e-secret-key"
# Metric names both backends report for a training step (the torch backend's names).
SHARED_METRICS = (
    "training/reward",
    "training/n_rollouts",
    "training/n_rollouts_w_trace",
    "training/n_sample",
    "training/n_sample_trained",
    "training/async/staleness_max_steps",
    "training/async/n_calls_wo_model_version",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/loss",
    "actor/lr",
    "timing/gen_s",
    "timing/update_s",
    "timing/step_s",
)
FINITE = ("training/reward", "actor/pg_loss", "actor/grad_norm")
RUN_KEYS = (
    f"data.train_batch_size={BATCH}",
    f"actor_rollout_ref.rollout.n={N}",
    # a mini-batch of N rows: a step trains unless most rollouts failed
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    # micro-batches that divide a mini-batch's rows (N) on 1 or 2 ranks: verl asserts it
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "trainer.save_freq=1",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.resume_mode=auto",
)
ASYNC_KEYS = (
    "agentlightning.async_rollout.enabled=true",
    f"agentlightning.async_rollout.async_train_batch_size={BATCH + 2}",
    "agentlightning.gateway.pause_retry_after_seconds=1",
)
LOGS = ("sync.log", "async.log", "resumed.log")


class Stack:
    """The gateway (its model name is the policy path, as verl serves it) and the controller; stopped by PID."""

    def __init__(self, policy: Path, work: Path):
        self.policy, self.work = policy, work
        self.gateway = GatewayServer(key=SECRET, model_name=str(policy))
        self.controller = Controller(self.gateway, POOL, work / "controller.log")

    def __enter__(self) -> Stack:
        try:
            self.gateway.start()
            self.controller.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.controller.stop()
        self.gateway.stop()


def train_command(
    gateway_url: str, key: str, policy: Path, run_dir: Path, steps: int, n_gpus: int, *keys: str
) -> tuple[list[str], dict[str, str]]:
    """``run_verl.sh`` for ``steps`` steps of this check's batch in ``run_dir``, with ``keys`` last (they
    win): the command and its environment."""
    env = {
        **os.environ,
        "MODEL_PATH": str(policy),
        "AGL_BASE_URL": gateway_url,
        "AGL_KEY": key,
        "N_GPUS": str(n_gpus),
        "STEPS": str(steps),
        "RUN_DIR": str(run_dir),
        "PYTHON": sys.executable,
        "PYTHONPATH": str(REPO_ROOT),
        "RAY_AUTH_MODE": "disabled",
        "AGL_DISABLE_PLUGIN_AUTOLOAD": "1",  # agl's built-ins only, whatever else is installed
    }
    return ["bash", str(RUN_VERL), *RUN_KEYS, *keys], env


class Run:
    """One ``agl train`` command in its own process group, logging to ``run_dir/<name>.log``; stopped
    with every process it started (Ray's, a launcher's workers in sessions of their own)."""

    def __init__(self, stack: Stack, run_dir: Path, command: list[str], env: dict[str, str], name: str):
        self.stack, self.run_dir = stack, run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log = run_dir / f"{name}.log"
        self.started = time.perf_counter()
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def failure(self) -> str:
        return (
            f"{self.log.read_text(errors='replace')[-6000:]}\n--- controller log:\n{self.stack.controller.log_text()}"
        )

    def finish(self, timeout: float) -> float:
        """Wait for a clean exit; the seconds it ran."""
        try:
            self.process.wait(timeout=timeout)
        finally:
            self.stop()
        if self.process.returncode != 0:
            raise RuntimeError(f"agl train ({self.log.name}) exited with {self.process.returncode}:\n{self.failure()}")
        return time.perf_counter() - self.started

    def wait_for_step(self, step: int, timeout: float) -> None:
        """Return once ``step`` is reported and verl has checkpointed it (verl's loop checkpoints a
        step before it reports it); fail if the run exits first or ``timeout`` passes."""
        marker = self.run_dir / "latest_checkpointed_iteration.txt"
        deadline = time.monotonic() + timeout
        while not (
            step in [row.get("step") for row in rows(self.run_dir)]
            and marker.is_file()
            and int(marker.read_text().strip() or 0) >= step
        ):
            if self.process.poll() is not None:
                raise RuntimeError(f"agl train exited before reporting step {step}:\n{self.failure()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"step {step} not reported and checkpointed within {timeout:g}s:\n{self.failure()}")
            time.sleep(0.2)

    def kill_after_step(self, step: int, timeout: float) -> None:
        """SIGKILL the whole process group once ``step`` is reported and checkpointed."""
        try:
            self.wait_for_step(step, timeout)
        finally:
            self.stop()

    def exit_code(self, timeout: float) -> int:
        """Wait for the run to exit by itself (killed after ``timeout``); its exit code."""
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self.stop()

    def stop(self) -> None:
        """SIGKILL the run's process group and every process it started, as a lost machine would end them."""
        import psutil

        if self.process.poll() is None:
            try:
                started = psutil.Process(self.process.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                started = []
            os.killpg(self.process.pid, signal.SIGKILL)
            for child in started:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            self.process.wait(timeout=60)


class Train(Run):
    """One ``run_verl.sh`` (``agl train`` with backend ``verl``) for ``steps`` steps."""

    def __init__(
        self,
        stack: Stack,
        run_dir: Path,
        steps: int,
        device_keys: Sequence[str],
        *overrides: str,
        name: str,
        n_gpus: int = 1,
    ):
        command, env = train_command(
            stack.gateway.url, stack.gateway.key, stack.policy, run_dir, steps, n_gpus, *device_keys, *overrides
        )
        super().__init__(stack, run_dir, command, env, name)


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def check_rows(rows: list[dict], steps: list[int]) -> list[str]:
    """What is wrong with these steps' metrics (empty when they are good): every rollout traced and
    none failed (a resumed run's first step too: its restored groups run again on the new replicas),
    rows trained, finite reward, loss and grad norm, the weights changed (a non-zero gradient in some
    step: a step whose groups all tie has none), every model call on a registered weight version,
    the metric names the torch backend reports."""
    rollouts = BATCH * N
    problems = []
    if [row.get("step") for row in rows] != steps:
        problems.append(f"steps logged: {[row.get('step') for row in rows]}, expected {steps}")
    for row in rows:
        step = row.get("step")
        n, traced = row.get("training/n_rollouts"), row.get("training/n_rollouts_w_trace")
        failed = row.get("training/rollouts/n_failed", 0)
        if not (n == traced == rollouts and not failed):
            problems.append(f"step {step}: rollouts {n}, traced {traced}, failed {failed}, expected {rollouts} traced")
        if not row.get("training/n_sample_trained"):
            problems.append(f"step {step}: no row trained")
        for key in FINITE:
            value = row.get(key)  # agl train writes a non-finite number as null
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                problems.append(f"step {step}: {key} = {value!r}, expected a finite number")
        if row.get("training/async/n_calls_wo_model_version", 0) != 0:
            problems.append(f"step {step}: model calls without a registered weight version")
        missing = [name for name in SHARED_METRICS if name not in row]
        if missing:
            problems.append(f"step {step}: lacks {missing}")
    # A step whose every group has equal rewards has zero advantages, so a zero gradient is right
    # there (likely with an untrained policy and few groups); one with a group to learn from must move.
    learnable = [row for row in rows if row.get("training/n_zero_adv_groups", 0) < row.get("training/n_groups", 0)]
    if learnable and not any(row.get("actor/grad_norm") for row in learnable):
        problems.append(
            f"steps {[row['step'] for row in learnable]}: zero gradients although a group's rewards differ, "
            "the weights never changed"
        )
    return problems


def report_lines(title: str, rows: list[dict], seconds: float) -> list[str]:
    keys = (
        *FINITE,
        "training/n_rollouts_w_trace",
        "training/rollouts/n_failed",
        "training/async/n_prev_carry_over_rollouts",
        "training/async/n_resumed_groups",
        "training/async/n_recreated_groups",
        "training/gateway/n_pauses_cleared",
        "timing/step_s",
    )
    lines = [f"{title} ({seconds:.0f}s)"]
    for row in rows:
        shown = {k.split("/")[-1]: round(v, 4) if isinstance(v := row.get(k), float) else v for k in keys}
        lines.append(f"  step {row['step']}: {shown}")
    return lines


def replay(stack: Stack, run_dir: Path, step: int, timeout: float) -> dict[str, float]:
    """``agl replay RUN --step N`` (the recorded run's backend and config): the step's metrics."""
    env = {**train_command(stack.gateway.url, stack.gateway.key, stack.policy, run_dir, step, 1)[1]}
    command = [sys.executable, "-m", "agl_core.cli", "replay", str(run_dir), "--step", str(step)]
    log = run_dir / "replay.log"
    with log.open("wb") as out:
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    text = log.read_text(errors="replace")
    if done.returncode:
        raise RuntimeError(f"agl replay exited with {done.returncode}:\n{text[-6000:]}")
    printed = (line.split(": ", 1) for line in text.splitlines() if ": " in line)
    return {name: float(value) for name, value in printed if "/" in name and _number(value)}


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


REPLAYED = ("training/reward", "training/n_rollouts", "training/n_sample_trained", "actor/grad_norm", "actor/pg_loss")


def check_replay(recorded: dict, replayed: dict[str, float]) -> list[str]:
    """The replayed step trained what the recorded one did, from the same weights (verl's checkpoint of
    the step before): the same rollouts and rows, and the same update within fp32 tolerance."""
    problems = []
    for name in REPLAYED:
        want, got = recorded.get(name), replayed.get(name)
        if not isinstance(want, (int, float)) or got is None or not math.isclose(want, got, rel_tol=1e-3, abs_tol=1e-5):
            problems.append(f"replayed step {recorded.get('step')}: {name} = {got!r}, recorded {want!r}")
    return problems


def scenario(
    stack: Stack,
    device_keys: Sequence[str],
    n_gpus: int = 1,
    timeout: float = 3600.0,
) -> tuple[list[str], list[str]]:
    """Sync (recorded, its step 2 replayed), then colocate_async with a kill and a resume, in one run
    folder: ``(problems, report lines)``."""
    run_dir = stack.work / "run"
    lines: list[str] = []
    recorded = "agentlightning.record_rollouts=true"
    seconds = Train(stack, run_dir, 2, device_keys, recorded, name="sync", n_gpus=n_gpus).finish(timeout)
    sync = rows(run_dir)
    lines += report_lines("sync", sync, seconds)
    problems = check_rows(sync, [1, 2])
    if not (run_dir / "global_step_2" / "actor").is_dir():
        problems.append("verl saved no actor checkpoint for step 2")
    if len(sync) == 2:
        started = time.perf_counter()
        replayed = replay(stack, run_dir, 2, timeout)
        shown = {k: replayed.get(k) for k in REPLAYED}
        lines.append(f"replay of step 2 ({time.perf_counter() - started:.0f}s): {shown}")
        problems += check_replay(sync[1], replayed)
    started = time.perf_counter()
    Train(stack, run_dir, 4, device_keys, *ASYNC_KEYS, name="async", n_gpus=n_gpus).kill_after_step(3, timeout)
    if not (run_dir / "global_step_3" / "transfer_queue").is_dir():
        problems.append("the groups in flight were not checkpointed with step 3 (verl's TransferQueue checkpoint)")
    Train(stack, run_dir, 4, device_keys, *ASYNC_KEYS, name="resumed", n_gpus=n_gpus).finish(timeout)
    async_rows = rows(run_dir)[2:]
    lines += report_lines("async, killed after step 3 and resumed", async_rows, time.perf_counter() - started)
    problems += check_rows(async_rows, [3, 4])
    if len(async_rows) == 2:
        resumed = async_rows[1]
        if (
            resumed.get("training/async/n_resumed_groups", 0)
            + resumed.get("training/async/n_resumed_backlog_samples", 0)
            <= 0
        ):
            problems.append("the resumed step restored no group in flight")
        for row in async_rows:
            if row.get("training/async/proxy_inflight_after_drain") != 0.0:
                problems.append(f"step {row['step']}: calls in flight after the drain")
    for name in (*LOGS, "replay.log", "metrics.jsonl", "rollouts.jsonl"):
        path = run_dir / name
        if path.is_file() and SECRET in path.read_text(errors="replace"):
            problems.append(f"the gateway key leaked into {name}")
    return problems, lines
