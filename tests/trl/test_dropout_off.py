"""The first mini-batch's ratio is 1 with a dropout model, on the torch and trl backends: their update
forward runs with the policy's dropout off (``agentlightning.disable_dropout``, the default), so it
computes the old log-probs' eval-mode values; turned off, the same step's ratio is not 1.

The recorded corridor step (tests/trl/recorded_step.py) on a copy of the corridor's policy whose
config gives attention dropout 0.5; one mini-batch, one epoch, so the step's ``actor/ppo_kl`` and
``actor/pg_clipfrac`` are the first mini-batch's.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.trl.recorded_step import build_backend, recorded_step


@pytest.fixture(scope="module")
def dropout_policy(corridor_policy, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dropout-policy")
    shutil.copytree(corridor_policy, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    return folder


@pytest.mark.parametrize(
    ("kind", "extra", "ratio_is_one"),
    [
        ("torch", (), True),
        ("trl", ("trl.use_cpu=true",), True),
        ("torch", ("agentlightning.disable_dropout=false",), False),
    ],
    ids=["torch", "trl", "torch-dropout_kept"],
)
def test_the_first_ratio_is_one_with_dropout_off(kind, extra, ratio_is_one, dropout_policy, tmp_path):
    backend = build_backend(kind, "token_mean", dropout_policy, tmp_path, extra)
    try:
        step = recorded_step(backend)
    finally:
        backend.close()
    assert step["n_mini"] == 1
    metrics = step["metrics"]
    if ratio_is_one:
        assert abs(metrics["actor/ppo_kl"]) <= 1e-6
        assert metrics["actor/pg_clipfrac"] == 0.0
    else:
        assert abs(metrics["actor/ppo_kl"]) > 1e-3
