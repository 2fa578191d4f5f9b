"""The backend contract (agl_core.testing.backend_contract) on ``trl``, replaying the corridor recording
against the reference backend: the same counts, gradient norms, loss terms and served policy after
every step, weight versions 0..3, a resumed run equal to an uninterrupted one, plugin failures isolated."""

from __future__ import annotations

from agl_backend_trl import plugin
from agl_core.testing.contracts import BackendContract
from tests.helpers.corridor_policy import shared_corridor_policy
from tests.helpers.paths import RECORDED_CORRIDOR


class TestTrlBackend(BackendContract):
    backend_name = "trl"
    plugins = (plugin,)

    def recorded(self, folder):
        """The corridor recording (tests/fixtures/corridor_recording), from the policy it was recorded with."""
        return RECORDED_CORRIDOR, shared_corridor_policy()
