"""``agl train examples/corridor/config.yaml backend=verl`` in verl's CPU mode, end to end on 127.0.0.1
(``tests/helpers/verl_e2e.py``): the real gateway and controller, a local Ray cluster, verl's FSDP2 workers
on 2 gloo ranks and the CPU replica, in each V1 trainer mode: 2 sync steps (recorded; step 2 replayed
by ``agl replay`` from verl's checkpoint), 2 colocate_async steps resumed from verl's checkpoint, a
kill and a resume with the groups in flight restored, and 2 separate_async steps with a standalone
CPU replica."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.ray, pytest.mark.gateway, pytest.mark.slow]

pytest.importorskip("ray")
pytest.importorskip("verl")

from agl_backend_verl.cpu import CPU_KEYS, mode_keys  # noqa: E402
from examples.corridor.build_policy import build  # noqa: E402
from tests.helpers.verl_e2e import Stack, scenario  # noqa: E402


def test_sync_then_async_then_kill_and_resume_from_verls_checkpoint(tmp_path):
    policy = build(tmp_path / "policy", seed=0)
    started = time.perf_counter()
    with Stack(policy, tmp_path) as stack:
        separate = (*mode_keys("separate_async"), "trainer.v1.separate_async.parameter_sync_step=2")
        problems, lines = scenario(stack, CPU_KEYS, n_gpus=2, separate_async_keys=separate)
    print("\n".join(["", *lines, f"end to end: {time.perf_counter() - started:.0f}s"]))
    assert not problems, "\n".join(problems)
