"""The backend contract (agl_core.testing.backend_contract) on the shipped backends, replaying the
corridor recording: the reference backend against itself."""

from __future__ import annotations

from agl_core.testing.contracts import BackendContract
from tests.helpers.corridor_policy import shared_corridor_policy
from tests.helpers.paths import RECORDED_CORRIDOR


class CorridorRecording:
    """Replays the corridor recording (tests/fixtures/corridor_recording), from the policy it was recorded with."""

    def recorded(self, folder):
        return RECORDED_CORRIDOR, shared_corridor_policy()  # one policy: one reference run for both classes


class TestTorchBackend(CorridorRecording, BackendContract):
    backend_name = "torch"

