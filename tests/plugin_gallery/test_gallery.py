"""The gallery's correct plugins pass every contract test (with their references): a contract that
failed them would be wrong. The whole gallery (every planted bug) is the slow test at the end."""

from __future__ import annotations

import pytest

from tests.plugin_gallery import gallery as g

_KINDS = list(g.KINDS.items())


def _contract(kind: str):
    base, correct, _, attributes = g.KINDS[kind]
    return type(f"TestCorrect{base.__name__}", (base,), {**attributes(correct), "__test__": True})


TestCorrectWindowedAggregator = _contract("aggregator (windowed, last K calls)")
TestCorrectLeaveOneOutEstimator = _contract("estimator (leave-one-out, length penalty)")
TestCorrectGspoLoss = _contract("policy loss (GSPO sequence ratio)")
TestCorrectCsvSink = _contract("metric sink (CSV)")
TestCorrectTaggingHook = _contract("lifecycle hook (tagging)")


@pytest.mark.slow
def test_the_contracts_catch_the_planted_bugs_with_a_reference():
    report = g.run_gallery()
    print(g.table(report))
    for entry in report.values():
        assert not [name for name, outcome in entry["correct"].items() if outcome not in ("pass", "skip")]
    bugs = [outcomes for entry in report.values() for outcomes in entry["bugs"].values()]
    caught = sum(1 for outcomes in bugs if g.caught_by(outcomes, with_reference=True))
    assert caught >= 0.9 * len(bugs), g.details(report)
