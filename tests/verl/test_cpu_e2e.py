"""``agl train examples/corridor/config.yaml backend=verl`` in verl's CPU mode, end to end on 127.0.0.1
(``tests/helpers/verl_e2e.py``): the real gateway and controller, a local Ray cluster, verl's FSDP2 workers
on 2 gloo ranks and the CPU replica; 2 sync steps, async steps resumed from verl's checkpoint, a
kill and a resume."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.ray, pytest.mark.gateway, pytest.mark.slow]

pytest.importorskip("ray")
pytest.importorskip("verl")

from agl_backend_verl.cpu import CPU_KEYS  # noqa: E402
from examples.corridor.build_policy import build  # noqa: E402
from tests.helpers.verl_e2e import Stack, scenario  # noqa: E402


def test_sync_then_async_then_kill_and_resume_from_verls_checkpoint(tmp_path):
    policy = build(tmp_path / "policy", seed=0)
    started = time.perf_counter()
    with Stack(policy, tmp_path) as stack:
        problems, lines = scenario(stack, CPU_KEYS, n_gpus=2)
    print("\n".join(["", *lines, f"end to end: {time.perf_counter() - started:.0f}s"]))
    assert not problems, "\n".join(problems)
