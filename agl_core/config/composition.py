"""Hydra's composition keys in a user's YAML: ``defaults`` and ``hydra``.

verl's run configs (Agent Lightning v1.0's verl config among them) are Hydra primary configs:
``defaults: [ppo_trainer, _self_]`` composes verl's trainer config under the file, and
``hydra.searchpath`` says where Hydra finds it. agl composes without Hydra: a backend's base config
already holds what it composes (the verl backend's base is verl's ``ppo_trainer``). So such a file
loads when its ``defaults`` name only configs the base holds, with ``_self_`` (if given) last — the
file over its defaults, as Hydra merges it — and its ``hydra`` section holds only ``searchpath``.
Anything else is a :class:`~agl_core.config.ConfigError` naming the entry; under a base that composes nothing (the
core schema of backend ``torch``) the error says which backend reads verl's configs.
"""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf

from agl_core.config.errors import ConfigError

__all__ = ["strip_composition"]

SELF = "_self_"


def strip_composition(user: DictConfig, origin: str, composed: Sequence[str]) -> DictConfig:
    """``user`` without ``defaults`` and ``hydra``, once they are checked against ``composed`` (the
    Hydra configs the base already holds, e.g. ``("ppo_trainer",)``)."""
    if "defaults" not in user and "hydra" not in user:
        return user
    if "defaults" in user:
        _check_defaults(user.defaults, origin, composed)
    if "hydra" in user:
        _check_hydra(user.hydra, origin, composed)
    plain = OmegaConf.to_container(user, resolve=False)
    assert isinstance(plain, dict)
    return OmegaConf.create({k: v for k, v in plain.items() if k not in ("defaults", "hydra")})


def _check_defaults(defaults: object, origin: str, composed: Sequence[str]) -> None:
    if not isinstance(defaults, ListConfig):
        raise ConfigError("defaults", f"must be Hydra's defaults list, got {defaults!r} (in {origin})")
    entries = list(defaults)
    for index, entry in enumerate(entries):
        if entry == SELF:
            if index != len(entries) - 1:
                raise ConfigError(
                    "defaults",
                    f"{SELF} must come last: agl merges the file over the configs it composes (in {origin})",
                )
            continue
        if entry in composed:
            continue
        if not composed and entry == "ppo_trainer":
            raise ConfigError(
                "defaults",
                f"composes verl's 'ppo_trainer' (in {origin}), which the core schema of this backend does not "
                "hold: run with backend=verl, whose base config is verl's ppo_trainer",
            )
        held = ", ".join(repr(c) for c in composed) or "nothing"
        raise ConfigError(
            "defaults",
            f"entry {OmegaConf.to_container(defaults)[index]!r} is not composed by agl, whose base config holds "
            f"{held} (in {origin}): set the keys that entry would select in the file itself",
        )


def _check_hydra(hydra: object, origin: str, composed: Sequence[str]) -> None:
    if not composed:
        raise ConfigError(
            "hydra",
            f"is the Hydra section of a verl config (in {origin}); this backend reads agl's core schema: run "
            "with backend=verl, or remove the section",
        )
    if not isinstance(hydra, DictConfig):
        raise ConfigError("hydra", f"must be a mapping, got {hydra!r} (in {origin})")
    for key in hydra.keys():
        if key != "searchpath":
            raise ConfigError(
                f"hydra.{key}",
                f"agl does not run through Hydra, so only hydra.searchpath (where verl's configs are) is "
                f"accepted; remove it (in {origin})",
            )
