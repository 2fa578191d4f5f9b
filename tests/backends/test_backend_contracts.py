"""The backend contract (agl_core.testing.backend_contract) on the shipped backends, replaying the
corridor recording: the reference backend against itself, and the data-parallel example backend."""

from __future__ import annotations

import sys

from agl_core.testing.contracts import BackendContract
from tests.helpers.corridor_policy import shared_corridor_policy
from tests.helpers.paths import RECORDED_CORRIDOR, REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "examples" / "ddp_backend"))  # as pip install -e examples/ddp_backend does
import agl_ddp_backend  # noqa: E402


class CorridorRecording:
    """Replays the corridor recording (tests/fixtures/corridor_recording), from the policy it was recorded with."""

    def recorded(self, folder):
        return RECORDED_CORRIDOR, shared_corridor_policy()  # one policy: one reference run for both classes


class TestTorchBackend(CorridorRecording, BackendContract):
    backend_name = "torch"


class TestDdpBackend(CorridorRecording, BackendContract):
    """Two gloo processes; each mini-batch's rows split between them."""

    backend_name = "ddp"
    plugins = (agl_ddp_backend,)
