"""Async training survives a kill: the groups in flight at the checkpoint are trained after the
restart, and no sample is lost or trained twice (``agl train`` against the real gateway)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import torch

from agl_core.backends.checkpoints import SOURCE_STATE_FILE, latest_checkpoint
from agl_core.testing.lifecycle import LifecycleLedger
from tests.helpers.corridor_policy import build_corridor_policy
from tests.helpers.gateway_fixtures import Plan, SimulatedController
from tests.helpers.paths import REPO_ROOT
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.gateway

N = 2  # rollouts per group
RECORDING_HOOK = '''
import json
import os
import time

from agl_core import hookimpl
from agl_core.builtins.aggregators import trajectory


def recorded(rollouts, settings):
    """The built-in trajectory aggregator, noting which rollouts each training step trains; a run
    with HOLD_AT_STEP stays in that step (past the previous step's checkpoint) until it is killed."""
    path = os.environ["TRAINED_FILE"]
    step = 1 + (sum(1 for _ in open(path)) if os.path.exists(path) else 0)
    if str(step) == os.environ.get("HOLD_AT_STEP"):
        time.sleep(3600)
    with open(path, "a") as f:
        f.write(json.dumps([[r.rollout_id, r.group_id, r.input["id"]] for r in rollouts]) + "\\n")
    return trajectory(rollouts, settings)


@hookimpl
def agl_register_aggregators(register):
    register("recorded", recorded)
'''


def plan(rollout):
    """Every fourth sample's agents take long, so groups stay in flight across steps."""
    return Plan(delay=1.5 if rollout["input"]["id"] % 4 == 3 else 0.05)


def in_flight_ids(checkpoint):
    """The dataset ids of the samples a checkpoint's rollout source carries."""
    source = torch.load(checkpoint / SOURCE_STATE_FILE, weights_only=False)
    ids = [r["input"]["id"] for g in source["groups"] for _, r in g["done"] if r is not None]
    ids += [p["request"]["input"]["id"] for p in source["pending"]]
    ids += [sample["id"] for sample in source["backlog"]]
    return set(ids)


def test_a_killed_async_run_trains_every_sample_in_flight_once(gateway, tmp_path):  # noqa: F811
    dataset = tmp_path / "rows.jsonl"
    # rows shaped like the example's: its config's env_map reads input.signs from every row
    dataset.write_text("".join(json.dumps({"id": i, "signs": ["left", "right", "left"]}) + "\n" for i in range(40)))
    hook = tmp_path / "recording_hook.py"
    hook.write_text(RECORDING_HOOK)
    run_dir = tmp_path / "run"
    overrides = [
        f"actor_rollout_ref.model.path={build_corridor_policy(tmp_path / 'policy')}",
        f"agentlightning.agl_base_url={gateway.url}",
        f"agentlightning.agl_key={gateway.key}",
        f"agentlightning.hooks={hook}",
        "agentlightning.trace_aggregator.level=recorded",
        "agentlightning.async_rollout.enabled=true",
        "agentlightning.async_rollout.async_train_batch_size=4",
        "agentlightning.gateway.poll_interval_min_seconds=0.02",
        "agentlightning.gateway.poll_interval_max_seconds=0.2",
        "agentlightning.gateway.drain_timeout_seconds=2",
        f"data.train_files={dataset}",
        "data.val_files=null",
        "data.train_batch_size=2",
        "data.shuffle=false",
        f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "algorithm.adv_estimator=grpo",
        f"trainer.default_local_dir={run_dir}",
        "trainer.total_training_steps=5",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.logger=[]",
    ]
    command = [
        sys.executable,
        "-m",
        "agl_core.cli",
        "train",
        str(REPO_ROOT / "examples/corridor/config.yaml"),
        *overrides,
    ]

    def start(trained_file, **env):
        env = {**os.environ, "TRAINED_FILE": str(trained_file), "AGL_DISABLE_PLUGIN_AUTOLOAD": "1", **env}
        return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO_ROOT)

    with SimulatedController(gateway, plan) as controller:
        first = start(tmp_path / "first.jsonl", HOLD_AT_STEP="3")  # it cannot get past step 2's checkpoint
        try:
            marker = run_dir / "latest_checkpointed_iteration.txt"

            def checkpointed_step_2():
                assert first.poll() is None, first.stderr.read().decode()[-3000:]
                return marker.is_file() and marker.read_text().strip() == "2"

            wait_until(checkpointed_step_2, "the first run's step-2 checkpoint", timeout=1800)
            first.send_signal(signal.SIGKILL)
        finally:
            first.kill()
            first.wait()
        second = start(tmp_path / "second.jsonl")
        _, err = second.communicate(timeout=1800)
        assert second.returncode == 0, err.decode()[-3000:]
    assert latest_checkpoint(run_dir).name == "global_step_5"

    at_end = torch.load(run_dir / "global_step_5" / "trainer_state.pt", weights_only=False)
    carried = in_flight_ids(run_dir / "global_step_2")
    assert carried, "the checkpoint of step 2 holds samples in flight"
    # the steps each run trained: the killed one's first two (checkpointed), the resumed one's 3 to 5
    steps = [json.loads(line) for line in (tmp_path / "first.jsonl").read_text().splitlines()][:2]
    steps += [json.loads(line) for line in (tmp_path / "second.jsonl").read_text().splitlines()]
    assert len(steps) == 5
    trained = Counter(sample_id for step in steps for _, _, sample_id in step)
    assert set(trained.values()) == {N}, f"every trained sample's group is trained once, whole: {trained}"
    handed_out = set(range(at_end["data"]["index"] * 2))
    assert at_end["data"]["epoch"] == 0
    assert set(trained) | in_flight_ids(run_dir / "global_step_5") == handed_out, "no sample handed out was lost"
    assert not set(trained) & in_flight_ids(run_dir / "global_step_5")
    assert carried <= set(trained) | in_flight_ids(run_dir / "global_step_5")
    resumed_step = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[2])
    assert resumed_step["step"] == 3
    assert resumed_step["training/async/n_resumed_groups"] + resumed_step[
        "training/async/n_resumed_backlog_samples"
    ] == len(carried)
    assert all(n == 1 for n in controller.started.values())


def test_a_restored_source_polls_its_rollouts_again_and_recreates_those_the_gateway_lost(gateway):  # noqa: F811
    """What a checkpoint keeps, taken over by a new source: a group that finished but was not taken
    yet, a pending rollout the gateway still holds (read under its own id once it finishes), one it
    no longer holds (re-created with the same request), and the backlog."""
    from agl_core.config import ConfigError
    from agl_core.rollouts.gateway import gateway_source
    from agl_core.rollouts.gateway_client import GatewayClient
    from tests.helpers.gateway_fixtures import async_config, gateway_config, plugin_manager

    release_3 = threading.Event()  # sample 3's agents finish only after the restore

    def plan(rollout):
        held = {3: Plan(release=release_3), 4: Plan(state=None)}  # the backlog's sample 4 never finishes
        return held.get(rollout["input"]["id"], Plan())

    ledger = LifecycleLedger()  # both sources' hooks: a re-created rollout is enqueued before it ends
    with SimulatedController(gateway, plan):
        before = gateway_source(async_config(gateway), plugin_manager(ledger))
        first = before.collect([{"id": 0}, {"id": 1}, {"id": 2}, {"id": 3}, {"id": 4}], step=1, is_train=True)
        taken = {r.input["id"] for r in first.rollouts}
        assert len(taken) == 2 and 3 not in taken
        before._wait(lambda: sum(g.complete for g in before.groups.values()) == 1)  # the third fast group
        state = before.state()
        assert [len(g["done"]) for g in state["groups"]] == [N, 0], "the finished group first"
        assert len(state["pending"]) == N and [s["id"] for s in state["backlog"]] == [4]
        lost = state["pending"][0]["request"]
        with GatewayClient(gateway.url, gateway.key) as client:
            client.delete_rollout(lost["rollout_id"])  # e.g. read and deleted by a run killed after the checkpoint
        before.pending.clear()  # a killed run deletes nothing more
        before.close()

        after = gateway_source(async_config(gateway), plugin_manager(ledger))
        assert after.restore(state) == 3  # two groups in flight and one waiting sample
        release_3.set()
        second = after.collect([], step=2, is_train=True)
    (left,) = {0, 1, 2} - taken
    assert sorted(r.input["id"] for r in second.rollouts) == sorted([left, left, 3, 3])
    ids = {r.rollout_id for r in second.rollouts}
    finished = {rid for rid, _ in state["groups"][0]["done"]}
    assert finished <= ids and state["pending"][1]["request"]["rollout_id"] in ids and lost["rollout_id"] not in ids
    assert {r.step for r in second.rollouts} == {1}, "restored groups keep the step they were enqueued at"
    m = second.metrics
    resumed = {name[len("training/async/n_resumed_") :]: value for name, value in m.items() if "n_resumed_" in name}
    assert resumed == {"groups": 2, "finished_rollouts": N, "pending_rollouts": N, "backlog_samples": 1}
    assert (m["training/rollouts/n_lost"], m["training/rollouts/n_reenqueued"]) == (1, 1)
    after.close()
    assert ledger.problems() == []
    (recreated,) = ids - finished - {p["request"]["rollout_id"] for p in state["pending"]}
    assert ledger.enqueued.count(recreated) == 1, "the re-created rollout went through agl_on_enqueue"

    with pytest.raises(ConfigError, match=r"agentlightning\.async_rollout\.enabled"):
        gateway_source(gateway_config(gateway), plugin_manager()).restore(state)


def test_a_restored_rollout_that_failed_while_no_trainer_ran_is_run_again(gateway):  # noqa: F811
    """Rollouts in flight at the checkpoint whose agents could reach only the stopped run's engines
    are re-created: one that failed before the resumed run registered its engines, and those whose
    attempt was already running when the run restored them and that fail afterwards (a call in
    flight to the stopped engines fails when the proxy gives up on it). One that failed after the
    registration while not running at the restore is a failure like any other."""
    from agl_core.rollouts.gateway import gateway_source
    from agl_core.rollouts.gateway_client import GatewayClient
    from tests.helpers.gateway_fixtures import async_config, patch_rollout, plugin_manager

    hold = {"on": True}  # while on, samples 1 and 3's agents never finish: they are in flight at the checkpoint

    def plan(rollout):
        return Plan(state=None) if hold["on"] and rollout["input"]["id"] in (1, 3) else Plan()

    ledger = LifecycleLedger()  # both sources' hooks: a re-created rollout is enqueued before it ends
    with SimulatedController(gateway, plan), GatewayClient(gateway.url, gateway.key) as client:
        before = gateway_source(async_config(gateway), plugin_manager(ledger))
        first = before.collect([{"id": 0}, {"id": 1}, {"id": 2}, {"id": 3}], step=1, is_train=True)
        assert {r.input["id"] for r in first.rollouts} == {0, 2}
        state = before.state()
        by_sample = {}
        for pending in state["pending"]:
            by_sample.setdefault(pending["request"]["input"]["id"], []).append(pending["request"]["rollout_id"])
        (unserved, later), running = by_sample[1], by_sample[3]
        before.pending.clear()  # the run is killed
        before.close()
        hold["on"] = False
        patch_rollout(client, unserved, state="failed", error_message="upstream model server request failed")
        time.sleep(0.05)  # the gateway's clock ticks past the failure before the resumed run registers

        after = gateway_source(async_config(gateway), plugin_manager(ledger))
        after.after_weight_update(["http://127.0.0.1:1/v1"], 1)
        time.sleep(0.05)  # and past the registration before the next failure
        patch_rollout(client, later, state="failed", error_message="the agent raised")
        assert after.restore(state) == 2
        for rid in running:  # their attempts started before the registration; they fail after it
            patch_rollout(client, rid, state="failed", error_message="upstream model server request failed")
        second = after.collect([], step=2, is_train=True)
        after.close()
    m = second.metrics
    assert m["training/async/n_resumed_failed_unserved"] == 3
    assert (m["training/rollouts/n_reenqueued"], m["training/rollouts/n_failed"]) == (3, 1)
    # the re-created ones, under fresh ids; the later failure is skipped
    assert sorted(r.input["id"] for r in second.rollouts) == [1, 3, 3]
    assert not {r.rollout_id for r in second.rollouts} & {unserved, later, *running}
    assert {r.state for r in second.rollouts} == {"succeeded"}
    assert ledger.problems() == []
    assert all(ledger.enqueued.count(r.rollout_id) == 1 for r in second.rollouts), "re-created through agl_on_enqueue"
