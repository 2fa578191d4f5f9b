"""The rollout sources backed by the real Agent Lightning gateway: which one a config asks for.

The synchronous source is :mod:`agl_core.rollouts.gateway_sync`, the asynchronous one
:mod:`agl_core.rollouts.gateway_async`; both talk to the gateway through
:mod:`agl_core.rollouts.gateway_client`.
"""

from __future__ import annotations

from omegaconf import DictConfig

from agl_core.plugins import PluginManager
from agl_core.rollouts.gateway_async import AsyncGatewayRolloutSource
from agl_core.rollouts.gateway_client import GatewayClient
from agl_core.rollouts.gateway_sync import GatewayRolloutSource

__all__ = ["gateway_source"]


def gateway_source(
    config: DictConfig, plugins: PluginManager, client: GatewayClient | None = None
) -> GatewayRolloutSource:
    """The sync or async gateway source, as ``agentlightning.async_rollout.enabled`` says."""
    if config.agentlightning.async_rollout.enabled:
        return AsyncGatewayRolloutSource(config, plugins, client)
    return GatewayRolloutSource(config, plugins, client)
