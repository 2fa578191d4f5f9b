"""The backend contract (agl_core.testing.backend_contract) on the reference backend against itself,
replaying the corridor recording. The data-parallel example backend passes it in its own tests
(examples/ddp_backend/tests, on the contract's default recording), as a third party's would."""

from __future__ import annotations

from agl_core.testing.contracts import BackendContract
from tests.helpers.corridor_policy import shared_corridor_policy
from tests.helpers.paths import RECORDED_CORRIDOR


class TestTorchBackend(BackendContract):
    backend_name = "torch"

    def recorded(self, folder):
        """The corridor recording (tests/fixtures/corridor_recording), from the policy it was recorded with."""
        return RECORDED_CORRIDOR, shared_corridor_policy()
