"""The built-in aggregators pass the contract suite that ships for third-party aggregators."""

from agl_core.testing.contracts import AggregatorContract


class TestTransitionContract(AggregatorContract):
    aggregator_name = "transition"


class TestTrajectoryContract(AggregatorContract):
    aggregator_name = "trajectory"
