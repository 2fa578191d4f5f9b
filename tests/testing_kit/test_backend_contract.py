"""The backend contract fails a backend that breaks what it checks: the reference backend with one
defect each, replaying the corridor recording (the passing runs are tests/backends/test_backend_contracts.py)."""

from __future__ import annotations

import time

import attrs
import pytest

from agl_core import Served, hookimpl
from agl_core.backends.torch.backend import TorchBackend
from agl_core.testing.backend_contract import ContractRuns
from agl_core.testing.contracts import BackendContract
from tests.helpers.corridor_policy import shared_corridor_policy
from tests.helpers.paths import RECORDED_CORRIDOR


class NeverPushes(TorchBackend):
    """Serves the starting weights and never the updated ones."""

    def serve(self, version):
        if self.engine is None:
            return super().serve(version)
        return Served([self.engine.base_url])


class TrainsHalfTheRows(TorchBackend):
    """Updates on the first half of the rows it is handed."""

    def update(self, prepared):
        half = len(prepared.shaped.rows) // 2
        shaped = attrs.evolve(
            prepared.shaped,
            rows=prepared.shaped.rows[:half],
            advantages=prepared.shaped.advantages[:half],
            kept_indices=prepared.shaped.kept_indices[:half],
            returns=prepared.shaped.returns[:half],
        )
        scales = None if prepared.row_scales is None else prepared.row_scales[:half]
        return super().update(attrs.evolve(prepared, shaped=shaped, row_scales=scales))


class ForgetsTheOptimizer(TorchBackend):
    """Resumes the weights but starts a fresh optimizer."""

    def load_checkpoint(self, folder, state):
        super().load_checkpoint(folder, {**state, "optimizer": self.optimizer.state_dict()})


class StepDoesNotAdvance(TorchBackend):
    """Trains step 1 again and again (its step counter goes back after every step)."""

    def train_step(self, samples):
        metrics = super().train_step(samples)
        self.step -= 1
        return metrics


class NeverTellsTheSource(TorchBackend):
    """Tells its rollout source of the starting weights only, never of a step's new ones."""

    def start(self):
        settings = super().start()
        self.source.after_weight_update = lambda endpoints, version: None
        return settings


class Hangs:
    """Serves version 0 over and over and never reports a step (for about 20 s, then gives up)."""

    def __init__(self, config, plugins):
        self.plugins = plugins

    def fit(self, on_step=None):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            self.plugins.on_weights_served(["http://127.0.0.1:9/v1"], 0)
            time.sleep(0.01)


class Defective:
    @hookimpl
    def agl_register_backends(self, register):
        register("never_pushes", NeverPushes)
        register("trains_half", TrainsHalfTheRows)
        register("forgets_optimizer", ForgetsTheOptimizer)
        register("step_does_not_advance", StepDoesNotAdvance)
        register("never_tells_the_source", NeverTellsTheSource)
        register("hangs", Hangs)


def contract(name):
    class Contract(BackendContract):
        backend_name = name
        plugins = (Defective(),)
        stall_timeout_seconds = 5.0 if name == "hangs" else BackendContract.stall_timeout_seconds

        def recorded(self, folder):
            return RECORDED_CORRIDOR, shared_corridor_policy()

    return Contract()


@pytest.mark.parametrize(
    ("backend", "check", "message"),
    [
        ("never_pushes", "test_weight_versions_advance_and_are_what_agents_are_served", "were not pushed"),
        ("never_pushes", "test_update_equals_the_reference", "the served policy differs from the reference's"),
        ("trains_half", "test_trains_the_rows_it_is_handed", "the gradient differs from the reference's"),
        ("forgets_optimizer", "test_a_resumed_run_continues_the_same_run", "differs from an uninterrupted run's"),
        ("step_does_not_advance", "test_reports_every_step_with_the_shared_metric_names", "does not advance"),
        ("never_tells_the_source", "test_trains_the_rows_it_is_handed", "did not call after_weight_update"),
        ("hangs", "test_reports_every_step_with_the_shared_metric_names", r"made no progress for 5 s"),
    ],
)
def test_the_contract_fails_a_defective_backend(tmp_path, backend, check, message):
    suite = contract(backend)
    with pytest.raises(AssertionError, match=message):
        getattr(suite, check)(ContractRuns(suite, tmp_path))
