"""``agl train … backend=verl`` end to end in verl's CPU mode on a Ray cluster of two nodes on 127.0.0.1
(``tests/helpers/verl_two_nodes.py``), one rank on each node, a CPU replica per rank listening on every
interface, the real gateway and controller (``tests/helpers/verl_e2e.py``), all started once:

- 2 sync steps, recorded, and step 2 replayed by ``agl replay`` from verl's checkpoint;
- colocate_async steps 3 and 4 resumed from verl's checkpoint, the run killed once step 3 is
  checkpointed and resumed with the groups in flight restored;
- a run that loses its worker node mid-step, resumed on the cluster made whole again.

verl's third trainer mode, ``separate_async``, runs through the gateway in
``tests/verl/test_cpu_separate_async.py`` (it needs rank pools one node of this cluster lacks)."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.ray, pytest.mark.gateway, pytest.mark.slow]

pytest.importorskip("ray")
pytest.importorskip("verl")

from agl_backend_verl.cpu import CPU_KEYS  # noqa: E402
from examples.corridor.build_policy import build  # noqa: E402
from tests.helpers.verl_e2e import Stack, scenario  # noqa: E402
from tests.helpers.verl_two_nodes import (  # noqa: E402
    node_lost_scenario,
    ranks_on_both_nodes,
    two_node_cluster,
    two_node_keys,
)


def test_sync_replay_async_kill_resume_and_a_lost_node_on_two_nodes(tmp_path):
    policy = build(tmp_path / "policy", seed=0)
    started = time.perf_counter()
    with two_node_cluster(tmp_path) as cluster, Stack(policy, tmp_path) as stack:
        problems, lines = scenario(stack, (*CPU_KEYS, *two_node_keys(cluster)), n_gpus=1)
        for check in (ranks_on_both_nodes(cluster), node_lost_scenario(stack, cluster, CPU_KEYS)):
            problems, lines = problems + check[0], lines + check[1]
    print("\n".join(["", *lines, f"end to end: {time.perf_counter() - started:.0f}s"]))
    assert not problems, "\n".join(problems)
