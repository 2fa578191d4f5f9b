"""``agl train … backend=verl`` in verl's CPU mode on a Ray cluster of two nodes on 127.0.0.1
(``tests/helpers/verl_two_nodes.py``): one rank on each node, a CPU replica per rank listening on every
interface, the real gateway and controller; 2 sync steps, then 2 async steps resumed from verl's
checkpoint; and a run that loses its worker node mid-step, resumed on the cluster made whole again."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.ray, pytest.mark.gateway, pytest.mark.slow]

pytest.importorskip("ray")
pytest.importorskip("verl")

from agl_backend_verl.cpu import CPU_KEYS  # noqa: E402
from examples.corridor.build_policy import build  # noqa: E402
from tests.helpers.verl_e2e import Stack  # noqa: E402
from tests.helpers.verl_two_nodes import node_lost_scenario, scenario, two_node_cluster  # noqa: E402


@pytest.mark.parametrize(
    "scenario_of",
    [scenario, node_lost_scenario],
    ids=["sync-then-async-steps", "a-lost-worker-node-then-resumed-on-a-whole-cluster"],
)
def test_two_nodes_one_rank_on_each(tmp_path, scenario_of):
    policy = build(tmp_path / "policy", seed=0)
    started = time.perf_counter()
    with two_node_cluster(tmp_path) as cluster, Stack(policy, tmp_path) as stack:
        problems, lines = scenario_of(stack, cluster, CPU_KEYS)
    print("\n".join(["", *lines, f"end to end: {time.perf_counter() - started:.0f}s"]))
    assert not problems, "\n".join(problems)
