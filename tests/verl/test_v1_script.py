"""An Agent Lightning v1.0 training script with one import changed (``tests/fixtures/v1_script``:
Hydra-composed verl config, in-memory datasets, ``run_ppo(config, train_dataset=..., val_dataset=...)``)
trains with the verl backend in verl's CPU mode, through the real gateway and controller on
127.0.0.1, and logs every step to the run log without an ``on_step``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.ray, pytest.mark.gateway, pytest.mark.slow]

pytest.importorskip("ray")
pytest.importorskip("hydra")

from agl_backend_verl.cpu import CPU_KEYS  # noqa: E402
from examples.corridor.build_policy import build  # noqa: E402
from tests.helpers.paths import FIXTURES, REPO_ROOT  # noqa: E402
from tests.helpers.verl_e2e import RUN_KEYS, Stack  # noqa: E402

STEPS = 2


def test_a_v1_script_with_one_import_changed_trains_with_verl(tmp_path):
    policy = build(tmp_path / "policy", seed=0)
    run_dir = tmp_path / "run"
    with Stack(policy, tmp_path) as stack:
        command = [
            sys.executable, str(FIXTURES / "v1_script" / "train_corridor.py"),
            "--agl-base-url", stack.gateway.url, "--agl-key", stack.gateway.key, "--model", str(policy),
            "agentlightning.backend=verl",
            *RUN_KEYS, *CPU_KEYS,
            "actor_rollout_ref.rollout.max_model_len=512",
            f"trainer.total_training_steps={STEPS}",
            "trainer.save_freq=-1",
            f"trainer.default_local_dir={run_dir}",
        ]  # fmt: skip
        env = {"PYTHONPATH": str(REPO_ROOT), "RAY_AUTH_MODE": "disabled", "AGL_DISABLE_PLUGIN_AUTOLOAD": "1"}
        done = subprocess.run(
            command, cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=1500
        )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print()
    for row in rows:
        print({k: row.get(k) for k in ("step", "training/n_rollouts", "training/n_sample_trained", "training/reward",
                                        "actor/pg_loss", "actor/grad_norm", "timing/step_s")})  # fmt: skip
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["training/n_rollouts"] > 0 and row["training/n_sample_trained"] > 0
        assert row["actor/grad_norm"] == row["actor/grad_norm"]  # finite: not NaN
    assert (run_dir / "datasets" / "train.jsonl").is_file()
