"""What ``agl check`` asks of the gateway a run will train through: that it is there, so a wrong URL
or key fails before a run rather than at its first step."""

from __future__ import annotations

from typing import Any

__all__ = ["check_gateway"]


def check_gateway(config: Any) -> str | None:
    """Ask the gateway at ``agentlightning.agl_base_url`` for its proxy state (a read that changes
    nothing), with the configured retries; a line for the report, or ``None`` without a gateway.
    A gateway that does not answer raises the client's ``GatewayError``."""
    if not config.agentlightning.agl_base_url:
        return None
    from agl_core.rollouts.gateway_client import GatewayClient  # httpx: only for a run with a gateway

    with GatewayClient.from_config(config) as client:
        client.proxy_state()
    return "gateway at agentlightning.agl_base_url: answers (GET /proxy/state)"
