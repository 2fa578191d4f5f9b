"""one_row_per_call keeps every invariant agl asks of an aggregator (agl's shipped contract suite)."""

import agl_one_row_per_call

from agl_core.testing.contracts import AggregatorContract


class TestOneRowPerCallContract(AggregatorContract):
    aggregator_name = "one_row_per_call"
    plugins = (agl_one_row_per_call,)
