"""verl 0.9.1 imports TRL's value-head model whenever TRL is installed; TRL 1.16 (the ``trl`` backend's)
has none, and verl's FSDP engine failed at start in an environment holding both backends
(``tests/verl/test_ppo_loss.py``'s FSDP steps run in such an environment in CI)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("verl")


def test_verl_is_told_trl_is_absent_where_trl_has_no_value_head_model():
    pytest.importorskip("trl")
    probe = (
        "from verl.models.transformers import monkey_patch; from verl.utils import import_utils, model; "
        "from agl_backend_verl.trl_value_head import trl_has_value_head_model; "
        "print(trl_has_value_head_model(), import_utils.is_trl_available(), monkey_patch.is_trl_available(), "
        "model.is_trl_available())"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False", "False"]
