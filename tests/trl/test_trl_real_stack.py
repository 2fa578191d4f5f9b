"""``agl train … backend=trl`` in two processes under ``torchrun`` (data-parallel over gloo) through the real
Agent Lightning gateway and ``agl-controller runner_type=local`` on 127.0.0.1, both started once
(``tests/helpers/verl_e2e.py``'s stack), in one run folder:

- 2 sync steps, checkpointed as TRL saves a model;
- async steps 3 and 4, the whole run (launcher and both processes) SIGKILLed once step 3 is
  reported and checkpointed, then resumed from that checkpoint: the model, optimizer and lr schedule,
  the data position and RNG states, and the groups in flight (carried rollouts) restored.

Every step is trained by both processes, traces and trains every rollout, none fails, the loss and
gradient are finite; the resumed step trains groups the killed run left in flight (only step 3's
checkpoint holds any: steps 1 and 2 ran sync).
"""

from __future__ import annotations

import os
import sys

import pytest

from agl_core.backends.checkpoints import SOURCE_STATE_FILE
from agl_core.serving.processes import free_port
from examples.corridor.build_policy import build
from tests.helpers.paths import REPO_ROOT
from tests.helpers.verl_e2e import ASYNC_KEYS, BATCH, N, Run, Stack, check_rows, report_lines, rows

pytestmark = [pytest.mark.gateway, pytest.mark.slow]

PROCESSES = 2
TIMEOUT = 1800.0


def train(stack: Stack, run_dir, steps: int, *overrides: str, name: str) -> Run:
    """``agl train`` of the corridor through the stack for ``steps`` steps, in :data:`PROCESSES` processes."""
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={PROCESSES}", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        "-m", "agl_core.cli", "train", str(REPO_ROOT / "examples" / "corridor" / "config.yaml"),
        "agentlightning.backend=trl",
        "trl.use_cpu=true",
        f"agentlightning.agl_base_url={stack.gateway.url}",
        f"agentlightning.agl_key={stack.gateway.key}",
        f"actor_rollout_ref.model.path={stack.policy}",
        f"data.train_batch_size={BATCH}",
        f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",  # N rows a mini-batch, 2 a process
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        f"trainer.default_local_dir={run_dir}",
        *overrides,
    ]  # fmt: skip
    env = {**os.environ, "AGL_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(REPO_ROOT)}
    return Run(stack, run_dir, command, env, name)


def test_two_processes_sync_then_async_killed_and_resumed_through_the_real_stack(tmp_path):
    policy = build(tmp_path / "policy", seed=0)
    run_dir = tmp_path / "run"
    with Stack(policy, tmp_path) as stack:
        sync = train(stack, run_dir, 2, name="sync")
        seconds = sync.finish(TIMEOUT)
        lines = report_lines("sync", rows(run_dir), seconds)
        problems = check_rows(rows(run_dir), [1, 2])
        if not (run_dir / "global_step_2" / "model" / "model.safetensors").is_file():
            problems.append("no model saved with step 2")

        train(stack, run_dir, 4, *ASYNC_KEYS, name="async").kill_after_step(3, TIMEOUT)
        if not (run_dir / "global_step_3" / SOURCE_STATE_FILE).is_file():
            problems.append("the groups in flight were not checkpointed with step 3")
        resumed = train(stack, run_dir, 4, *ASYNC_KEYS, name="resumed")
        seconds = resumed.finish(TIMEOUT)
        async_rows = rows(run_dir)[2:]
        lines += report_lines("async, killed after step 3 and resumed", async_rows, seconds)
        problems += check_rows(async_rows, [3, 4])
        trained_in = {row["step"]: row.get("actor/n_processes") for row in rows(run_dir)}
        if set(trained_in.values()) != {PROCESSES}:
            problems.append(f"processes that trained each step: {trained_in}, expected {PROCESSES}")
        if len(async_rows) == 2 and async_rows[1].get("training/async/n_resumed_groups", 0) <= 0:
            problems.append("the resumed step restored no group in flight")
    print("\n".join(lines))
    assert problems == [], "\n".join(problems)
