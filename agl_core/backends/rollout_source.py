"""Which rollout source a run trains on: the one choice every backend makes the same way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agl_core.config import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from agl_core.plugins import PluginManager
    from agl_core.rollouts.source import RolloutSource

__all__ = ["check_rollout_source", "open_rollout_source"]


def check_rollout_source(config: DictConfig) -> None:
    """Refuse what no source can run, before anything is built (``agl check`` runs it too): async
    rollout runs through the gateway only, and the embedded agents' class must import."""
    agl = config.agentlightning
    if agl.async_rollout.enabled and not agl.agl_base_url:
        raise ConfigError(
            "agentlightning.async_rollout.enabled",
            "async rollout runs through the gateway: set agentlightning.agl_base_url"
            " (the embedded source is sync only)",
        )
    if not agl.agl_base_url and not agl.replay:
        from agl_core.rollouts.agents import load_agent_class

        load_agent_class(agl.local.agent_class)


def open_rollout_source(
    config: DictConfig, plugins: PluginManager, tokenizer: Any, endpoints: Sequence[str] = ()
) -> RolloutSource:
    """The run's rollout source, started; the caller closes it.

    ``agentlightning.replay`` set: the recording's steps (:class:`~agl_core.rollouts.replay.ReplayRolloutSource`,
    checked against ``tokenizer``); else ``agentlightning.agl_base_url`` set: the gateway's sources
    (:func:`~agl_core.rollouts.gateway.gateway_source`; sync or async); else agents in threads of this
    process (:class:`~agl_core.rollouts.embedded.EmbeddedRolloutSource`) calling ``endpoints[0]``,
    the OpenAI base URL the backend serves its policy at, as model ``actor_rollout_ref.model.path``.
    """
    check_rollout_source(config)
    agl = config.agentlightning
    if agl.replay:
        from agl_core.rollouts.replay import ReplayRolloutSource

        return ReplayRolloutSource(config, tokenizer)
    if agl.agl_base_url:
        from agl_core.rollouts.gateway import gateway_source

        return gateway_source(config, plugins)
    if not endpoints:
        raise ConfigError(
            "agentlightning.agl_base_url",
            "agents run in this process only against an engine the backend serves, and it serves none: "
            "set agentlightning.agl_base_url (the gateway) or agentlightning.replay",
        )
    from agl_core.rollouts.embedded import EmbeddedRolloutSource

    return EmbeddedRolloutSource(config, plugins, endpoints[0], str(config.actor_rollout_ref.model.path))
