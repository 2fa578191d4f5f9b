"""retoken_merge keeps every invariant agl asks of an aggregator (the shipped contract suite)."""

import agl_retoken_merge

from agl_core.testing.contracts import AggregatorContract


class TestRetokenMergeContract(AggregatorContract):
    aggregator_name = "retoken_merge"
    plugins = (agl_retoken_merge,)
    # Merged rows keep the model's own ids where the server saw retokenized ones: they match the
    # last merged call on decoded text, not on ids.
    exact_token_context = False
