"""A short soak (benchmarks/bench_soak.py): 60 async steps through the real gateway with faults and the
1,000-step run's checks. RSS is held to 60% per 100 steps, not 1%: 60 steps are mostly warm-up (the
allocator's arenas and torch's caches fill over the first tens of steps), so this catches a leak of
megabytes per step, and the long run measures flatness."""

from __future__ import annotations

import pytest

from benchmarks.bench_soak import Faults, print_report, problems, soak

pytestmark = [pytest.mark.slow, pytest.mark.gateway, pytest.mark.soak]


def test_a_short_soak_survives_its_faults_stays_flat_and_accounts_for_every_sample(tmp_path):
    faults = Faults(restart_every=20, hook_raise_every=10)
    report = soak(steps=60, every=10, out=tmp_path, faults=faults)
    print_report(report)
    assert report["accounting"]["gateway_restarts_injected"] == 3 and report["accounting"]["hook_raises_scheduled"] > 0
    assert report["accounting"]["rollouts_by_outcome"].get("failed", 0) > 0  # the crashing agents
    assert problems(report, rss_tolerance=0.6, faults=faults) == []
