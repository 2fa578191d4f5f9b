"""Keys of older verl configs (verl 0.7 / 0.8, as Agent Lightning v1.0's examples were written for)
that verl 0.9 moved or removed, so that an unknown-key error says where the setting went.

Established by comparing the flattened ``_generated_ppo_trainer.yaml`` of verl 0.7.1, 0.8.0 and 0.9.1
(and ``ppo_trainer.yaml`` back to 0.5): a key is *moved* where the same setting (same leaf names,
same defaults) reappears elsewhere, *removed* where nothing replaces it. ``trainer.nccl_timeout`` was
never a key of verl's FSDP trainer config (the process-group timeout has been
``actor_rollout_ref.nccl_timeout`` since verl 0.5); v1.0's swe_smith example sets it there, which v1.0's
struct-less merge let through unread.
"""

from __future__ import annotations

from agl_core import ConfigError

__all__ = ["MOVED", "REMOVED", "with_moved_key_hint"]

# old key -> (its place in verl 0.9, when it moved)
MOVED: dict[str, tuple[str, str]] = {
    "trainer.nccl_timeout": ("actor_rollout_ref.nccl_timeout", "where verl reads the process-group timeout"),
    "critic.model.fsdp_config": ("critic.fsdp", "in verl 0.8"),
    "actor_rollout_ref.rollout.skip_rollout": ("skip.rollout.enable", "in verl 0.8, then 0.9"),
    "actor_rollout_ref.rollout.skip_dump_dir": ("skip.rollout.dump_dir", "in verl 0.8, then 0.9"),
    # verl 0.8's rollout.skip.{enable, dump_dir, action}; its max_dump_step became skip.rollout.steps (a list)
    "actor_rollout_ref.rollout.skip": ("skip.rollout", "in verl 0.9"),
}

# old key -> the last verl release with it (verl 0.9 has no replacement)
REMOVED: dict[str, str] = {
    "data.sampler": "0.7",
    "data.datagen": "0.7",
    "trainer.use_legacy_worker_impl": "0.7",
    "actor_rollout_ref.actor.sum_pi_squared_checkpointing": "0.7",
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": "0.7",
    "actor_rollout_ref.actor.router_replay": "0.8",
    "actor_rollout_ref.ref.router_replay": "0.8",
    "actor_rollout_ref.actor.checkpoint.mbridge_config": "0.8",
    "critic.checkpoint.mbridge_config": "0.8",
}


def _entry(key: str, table: dict) -> str | None:
    """The entry of ``table`` that ``key`` is, or lies under."""
    return next((old for old in table if key == old or key.startswith(old + ".")), None)


def with_moved_key_hint(error: ConfigError) -> ConfigError:
    """``error`` (an unknown key) saying where verl 0.9 moved the key, or that it removed it."""
    if not error.message.startswith("unknown key"):
        return error
    message = error.message.split("; did you mean", 1)[0]
    old = _entry(error.key, MOVED)
    if old is not None:
        new, when = MOVED[old]
        return ConfigError(error.key, f"{message}; moved to {new + error.key[len(old) :]} ({when}): set it there")
    old = _entry(error.key, REMOVED)
    if old is not None:
        return ConfigError(
            error.key, f"{message}; a key of verl {REMOVED[old]}, which verl 0.9 removed without a replacement"
        )
    return error
