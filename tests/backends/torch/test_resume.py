"""An interrupted run continues from its last checkpoint with the same data order and state."""

from __future__ import annotations

import json

import pytest
import torch

from agl_core import hookimpl
from agl_core.backends.checkpoints import latest_checkpoint
from agl_core.runs.train import run
from tests.helpers.corridor_policy import build_corridor_policy
from tests.helpers.torch_runs import CONFIG, resume_overrides


class SeenInputs:
    """Records which dataset rows each step enqueued."""

    def __init__(self):
        self.by_step: dict[int, list[int]] = {}

    @hookimpl
    def agl_on_enqueue(self, request):
        self.by_step.setdefault(request.step, [])
        if request.input["id"] not in self.by_step[request.step]:
            self.by_step[request.step].append(request.input["id"])


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_corridor_policy(tmp_path_factory.mktemp("policy"))


def test_restart_continues_from_step_k_with_the_same_data_order(policy, tmp_path):
    straight = SeenInputs()
    run(CONFIG, resume_overrides(policy, tmp_path / "straight", 4), plugins=[straight], show_progress=False)

    interrupted = SeenInputs()
    run(CONFIG, resume_overrides(policy, tmp_path / "resumed", 2), plugins=[interrupted], show_progress=False)
    assert latest_checkpoint(tmp_path / "resumed").name == "global_step_2"
    state_after_2 = torch.load(tmp_path / "resumed" / "global_step_2" / "trainer_state.pt", weights_only=False)
    resumed = SeenInputs()
    run(CONFIG, resume_overrides(policy, tmp_path / "resumed", 4), plugins=[resumed], show_progress=False)

    assert sorted(resumed.by_step) == [3, 4]  # nothing before step k was redone
    assert interrupted.by_step == {1: straight.by_step[1], 2: straight.by_step[2]}
    assert resumed.by_step == {3: straight.by_step[3], 4: straight.by_step[4]}
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert state_after_2["step"] == 2 and state_after_2["data"] == {"epoch": 0, "index": 2}
    assert state_after_2["optimizer"]["state"], "the optimizer's moments are saved"


def test_resume_mode_disable_starts_over(policy, tmp_path):
    run(CONFIG, resume_overrides(policy, tmp_path, 1), show_progress=False)
    again = SeenInputs()
    run(
        CONFIG,
        [*resume_overrides(policy, tmp_path, 1), "trainer.resume_mode=disable"],
        plugins=[again],
        show_progress=False,
    )
    assert sorted(again.by_step) == [1]


SEEN_HOOK = """
import json
import os
import time

from agl_core import hookimpl


@hookimpl
def agl_on_enqueue(request):
    with open(os.environ["SEEN_FILE"], "a") as f:
        f.write(json.dumps({"step": request.step, "id": request.input["id"]}) + "\\n")
    if str(request.step) == os.environ.get("HOLD_AT_STEP"):
        time.sleep(3600)  # the run stays in this step, past the previous step's checkpoint, until killed
"""


def _expected_batches(overrides, steps):
    """The dataset rows each step trains on, from the data order alone (no run needed)."""
    from agl_core.backends.data_order import DataOrder
    from agl_core.config import load_config
    from agl_core.files.datasets import load_dataset

    config = load_config(CONFIG, overrides)
    order = DataOrder(
        load_dataset(config.data.train_files), int(config.data.train_batch_size), True, int(config.trainer.seed)
    )
    return {step: [row["id"] for row in order.next_batch()] for step in range(1, steps + 1)}


def _seen(path):
    by_step: dict[int, list[int]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        ids = by_step.setdefault(record["step"], [])
        if record["id"] not in ids:
            ids.append(record["id"])
    return by_step


def test_a_killed_agl_train_restarts_from_its_last_checkpoint(policy, tmp_path):
    """SIGKILL ``agl train`` once the step-2 checkpoint is on disk (the first run is held in step 3,
    so it cannot get further whatever the machine's load); the restart trains steps 3 and 4 on the
    rows a straight run would have used."""
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers.waiting import wait_until

    hook = tmp_path / "seen_hook.py"
    hook.write_text(SEEN_HOOK)
    run_dir = tmp_path / "run"
    overrides = [
        *resume_overrides(policy, run_dir, 4),
        "trainer.test_freq=-1",
        f"agentlightning.hooks={hook}",
        "agentlightning.hook_timeout_seconds=3600",  # the held hook call is never abandoned
    ]
    command = [sys.executable, "-m", "agl_core.cli", "train", CONFIG, *overrides]

    def start(seen_file, **env):
        env = {**os.environ, "SEEN_FILE": str(seen_file), "AGL_DISABLE_PLUGIN_AUTOLOAD": "1", **env}
        return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    first = start(tmp_path / "first.jsonl", HOLD_AT_STEP="3")
    try:
        marker = run_dir / "latest_checkpointed_iteration.txt"

        def checkpointed_step_2():
            assert first.poll() is None, first.stderr.read().decode()[-2000:]
            return marker.is_file() and marker.read_text().strip() == "2"

        wait_until(checkpointed_step_2, "the first run's step-2 checkpoint", timeout=1800)
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first.wait()
    steps_before = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    second = start(tmp_path / "second.jsonl")
    _, err = second.communicate(timeout=1800)
    assert second.returncode == 0, err.decode()[-2000:]

    expected = _expected_batches(overrides, 4)
    assert _seen(tmp_path / "first.jsonl")[1] == expected[1] and _seen(tmp_path / "first.jsonl")[2] == expected[2]
    assert _seen(tmp_path / "second.jsonl") == {3: expected[3], 4: expected[4]}
    steps_after = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps_before[:2] == [1, 2], "a step is logged before its checkpoint is written"
    assert steps_after == [1, 2, 3, 4], "one line per step, whatever the first run logged after its checkpoint"
    assert latest_checkpoint(run_dir).name == "global_step_4"
