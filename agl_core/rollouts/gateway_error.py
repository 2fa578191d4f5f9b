"""The error of a gateway call that failed for good, shared by the client and its retry policy."""

from __future__ import annotations

from agl_core.errors import AglError

__all__ = ["GatewayError"]


class GatewayError(AglError):
    """A gateway call failed for good.

    ``status`` is the HTTP status (``None`` when no answer came: timeout, connection error),
    ``endpoint`` the method and path, ``message`` the server's ``detail`` or the transport error.
    ``ambiguous`` is true when the request may have been applied although no answer confirmed it.
    ``transient`` is set by the retry loop that gave up (:meth:`~agl_core.rollouts.retry.RetryPolicy.run`):
    true when the failure is one the policy retries (the gateway may answer the next call), so only
    the attempts ran out; a source that polls carries on after a transient failure.
    """

    __module__ = "agl_core"

    hint = "is the gateway running at agentlightning.agl_base_url, with agentlightning.agl_key?"

    def __init__(self, endpoint: str, status: int | None, message: str, *, ambiguous: bool = False):
        self.endpoint = endpoint
        self.status = status
        self.message = message
        self.ambiguous = ambiguous
        self.transient = False
        answer = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"gateway {endpoint}: {answer}: {message}")

    @property
    def not_found(self) -> bool:
        return self.status == 404
