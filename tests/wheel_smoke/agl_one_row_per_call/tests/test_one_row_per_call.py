"""one_row_per_call keeps every invariant agl asks of an aggregator (agl's shipped contract suite)."""

from agl_core.testing.contracts import AggregatorContract


class TestOneRowPerCallContract(AggregatorContract):
    aggregator_name = "one_row_per_call"
