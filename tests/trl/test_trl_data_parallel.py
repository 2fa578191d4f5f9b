"""Two processes under torchrun (accelerate's data-parallel process model over gloo) make the
update one process makes, on the recorded corridor step, and end their process group cleanly.

Each case of :data:`~tests.trl.recorded_step.DATA_PARALLEL_CASES` (token_mean over 2 mini-batches in
micro-batches of 3 rows; per_rollout_mean over 2 mini-batches × 2 PPO epochs with the entropy bonus
and the KL term in token-budget micro-batches, each process splitting its share by the budget;
per_rollout_mean with LoRA and bf16 forward passes) is trained in this process and in two launched
by ``torchrun`` (one launch for all cases). Compared: the update's loss terms and gradient norm
(relative ≤ 1e-5, or absolute ≤ 1e-6 near 0) and the updated policy's log-probs (max abs ≤ 1e-5);
with bf16 forward passes, to bf16's rounding (relative ≤ 1e-3, log-probs ≤ 2e-2). The two processes'
sums of the loss run in another order than one process's, so they agree to float rounding, not bit
for bit. After the cases, the processes end the process group as a run does: no gloo worker thread
is left to release a collective while the interpreter shuts down (which aborts the process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from agl_core.serving.processes import free_port
from tests.helpers.paths import REPO_ROOT
from tests.trl.recorded_step import DATA_PARALLEL_CASES, build_backend, recorded_step

METRIC_RTOL, METRIC_ATOL, AFTER_ATOL = 1e-5, 1e-6, 1e-5
# bf16 forward passes round each matmul's output to 8 bits of mantissa (a relative 2^-8 = 3.9e-3), and a
# share's matmuls have other shapes than the whole mini-batch's, so the two updates agree to that rounding.
BF16_METRIC_RTOL, BF16_AFTER_ATOL = 1e-3, 2e-2
METRICS = ("actor/pg_loss", "actor/entropy_loss", "actor/loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl")


@pytest.fixture(scope="module")
def two_processes(corridor_policy, tmp_path_factory):
    """Every case's update in two processes, and the gloo worker threads left after the end (process 0's)."""
    root = tmp_path_factory.mktemp("trl-two-processes")
    out = root / "results.pt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "tests.trl.recorded_step", str(out), str(corridor_policy), str(root / "runs"),
    ]  # fmt: skip
    env = {**os.environ, "AGL_DISABLE_PLUGIN_AUTOLOAD": "1"}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("case", list(DATA_PARALLEL_CASES))
def test_two_processes_make_the_one_process_update(two_processes, corridor_policy, tmp_path, case):
    torch.set_num_threads(1)
    loss, extra = DATA_PARALLEL_CASES[case]
    one = recorded_step(build_backend("trl", loss, corridor_policy, tmp_path, (*extra, "trl.use_cpu=true")))
    two = two_processes["cases"][case]
    rtol, after_atol = (BF16_METRIC_RTOL, BF16_AFTER_ATOL) if "bf16" in case else (METRIC_RTOL, AFTER_ATOL)
    assert two["world"] == 2
    assert two["metrics"]["actor/n_updates"] == one["metrics"]["actor/n_updates"]
    far = {
        name: (got, want)
        for name in METRICS
        if not abs((got := two["metrics"][name]) - (want := one["metrics"][name])) <= max(rtol * abs(want), METRIC_ATOL)
    }
    after = float((two["after"] - one["after"]).abs().max())
    print(case, "log-probs after, max abs:", after, {n: two["metrics"][n] - one["metrics"][n] for n in METRICS})
    assert far == {}, f"{case}: metrics beyond the tolerances (two processes, one): {far}"
    assert after <= after_atol, f"{case}: the updated policies' log-probs differ by {after}"


def test_two_processes_end_with_no_gloo_worker_thread_left(two_processes):
    assert two_processes["gloo_worker_threads_after_end"] == 0
