"""Agent Lightning keys agl does not honour: each is refused by name, with the reason, before the
user's config is merged (where it would be an unknown key without a reason, or a key accepted and
never read).

A key is refused only where the base config lacks it: a backend that honours one holds it in its
base, and the refusal no longer applies there.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from agl_core.config.errors import ConfigError

__all__ = ["UNHONOURED", "refuse_unhonoured"]

ROUTER_REPLAY = (
    "is Agent Lightning 1.0.2's MoE router replay (R3: the experts vLLM routed each token to, recorded "
    "by the gateway with default_proxy.include_routed_experts, replayed in the update), which agl does "
    "not honour: agl's rows do not carry the recorded routes, the torch backend routes every token "
    "with the policy being trained, and verl 0.9.1 replays routes only in its Megatron and VeOmni "
    "engines, which agl's verl backend (FSDP) does not build; remove the key (the update then routes "
    "as the current policy does)"
)

# Key (or section) -> why agl refuses it.
UNHONOURED: dict[str, str] = {
    "actor_rollout_ref.actor.megatron.router_replay": ROUTER_REPLAY,
    "actor_rollout_ref.ref.megatron.router_replay": ROUTER_REPLAY,
}

_ABSENT = object()


def _first_leaf(node: object, key: str) -> str:
    """``key``, or the first key set under it when it is a section (the key the user wrote)."""
    while isinstance(node, DictConfig) and len(node):
        name = next(iter(node.keys()))
        key, node = f"{key}.{name}", node._get_node(name)
    return key


def refuse_unhonoured(user: DictConfig, base: DictConfig, origin: str) -> None:
    """Raise a :class:`ConfigError` for the first key of :data:`UNHONOURED` that ``user`` sets and
    ``base`` lacks, naming the key the user wrote and the reason (``origin``: the file, or overrides)."""
    for key, reason in UNHONOURED.items():
        node = OmegaConf.select(user, key, default=_ABSENT, throw_on_missing=False)
        if node is _ABSENT or OmegaConf.select(base, key, default=_ABSENT, throw_on_missing=False) is not _ABSENT:
            continue
        raise ConfigError(_first_leaf(node, key), f"{reason} (in {origin})")
