"""The run config: Agent Lightning v1.0's ``agentlightning`` section over verl's key layout.

A config is an omegaconf ``DictConfig`` with verl's top-level sections (``data``,
``actor_rollout_ref``, ``algorithm``, ``trainer``) and the ``agentlightning`` section. agl's own
settings live only in ``agentlightning`` (verl's dataclass sections refuse extra keys). The core
schema below holds the verl keys agl itself reads, with verl's names and defaults, so one config
file serves every backend; a backend may compose over a larger base (the verl backend uses verl's
full ``ppo_trainer`` defaults).

:func:`load_config` merges base → user YAML → ``key=value`` overrides and validates once; every
error is a :class:`ConfigError` that names the key path. :func:`redacted` / :func:`to_yaml` hide the
gateway key in every dump.
"""

from agl_core.config.checks import row_length_keys
from agl_core.config.checks import validate as validate_config
from agl_core.config.errors import ConfigError
from agl_core.config.loading import (
    REDACTED,
    ConfigFile,
    load_config,
    merge_config,
    read_config_file,
    redacted,
    to_yaml,
    with_backend_hint,
)
from agl_core.config.schema import (
    LOSS_NORMALIZATION_MODES,
    SECRET_KEYS,
    AgentLightningConfig,
    CoreConfig,
    default_config,
)

__all__ = [
    "REDACTED",
    "SECRET_KEYS",
    "LOSS_NORMALIZATION_MODES",
    "AgentLightningConfig",
    "ConfigError",
    "ConfigFile",
    "CoreConfig",
    "default_config",
    "load_config",
    "merge_config",
    "read_config_file",
    "redacted",
    "row_length_keys",
    "to_yaml",
    "validate_config",
    "with_backend_hint",
]
