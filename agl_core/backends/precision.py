"""The dtypes of training, under verl's FSDP engine keys (``actor_rollout_ref.actor.fsdp_config``), for
the backends that read them (the torch backend autocasts with :class:`Precision`; the trl backend
hands the compute dtype to TRL's mixed precision).

``model_dtype`` is the dtype the weights are loaded, trained and optimised in (verl: the dtype the
transformers model is built in). ``mixed_precision.param_dtype`` is the dtype the forward passes compute
in, by autocast over weights that stay in ``model_dtype`` (verl: FSDP's mixed-precision parameter
dtype, which its engine also autocasts to). Whatever the compute dtype, the log-softmax, log-probs,
log-prob ratios, advantages and the loss are float32 (:mod:`agl_core.backends.ppo` casts
the logits up), as in verl.

One difference from verl's defaults: verl's FSDP engine computes in bf16 when ``mixed_precision`` is
null; here null means no autocast, so a config that sets nothing trains in float32. fp16 is refused
(it needs loss scaling, which agl does not do). ``reduce_dtype`` and ``buffer_dtype`` are accepted as
fp32 only: gradients are reduced (across data-parallel processes) in the weights' float32, and
buffers are not cast.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import attrs

from agl_core.config import ConfigError

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

__all__ = ["MIXED_PRECISION_KEY", "MODEL_DTYPE_KEY", "Precision", "dtype_names"]

MODEL_DTYPE_KEY = "actor_rollout_ref.actor.fsdp_config.model_dtype"
MIXED_PRECISION_KEY = "actor_rollout_ref.actor.fsdp_config.mixed_precision"
# verl's names for the dtypes this backend trains in (verl.utils.torch_dtypes.PrecisionType's
# spellings) -> torch's name of the dtype.
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
FP16_NAMES = ("fp16", "float16", "16")


def _dtype_name(value: object, key: str) -> str:
    """torch's name of the dtype verl's name ``value`` stands for; ``key`` names it in the error."""
    name = str(value).lower()
    if name in FP16_NAMES:
        raise ConfigError(key, "fp16 needs loss scaling, which agl does not do; use bf16 or fp32")
    if name not in DTYPE_NAMES:
        raise ConfigError(key, f"must be one of fp32, bf16 (or float32, bfloat16), got {value!r}")
    return DTYPE_NAMES[name]


def dtype_names(fsdp_config: DictConfig) -> tuple[str, str | None]:
    """torch's names of the weights' dtype and of the dtype forward passes autocast to (``None``: no
    autocast), as ``fsdp_config`` says; every refusal is a :class:`ConfigError` naming its key. Needs
    no torch, so ``agl check`` runs it without importing torch."""
    weights = _dtype_name(fsdp_config.model_dtype, MODEL_DTYPE_KEY)
    mixed = fsdp_config.get("mixed_precision")  # verl's own config leaves the key out
    if mixed is None:
        return weights, None
    for field in ("reduce_dtype", "buffer_dtype"):
        if _dtype_name(mixed[field], f"{MIXED_PRECISION_KEY}.{field}") != "float32":
            raise ConfigError(
                f"{MIXED_PRECISION_KEY}.{field}",
                "agl keeps it in fp32 (gradients reduced in fp32, buffers not cast); set fp32 or leave it out",
            )
    compute = _dtype_name(mixed.param_dtype, f"{MIXED_PRECISION_KEY}.param_dtype")
    if compute == "float32" and weights != "float32":
        raise ConfigError(
            f"{MIXED_PRECISION_KEY}.param_dtype",
            f"fp32 compute over {MODEL_DTYPE_KEY} bf16 weights is not done; set model_dtype fp32",
        )
    return weights, None if compute in ("float32", weights) else compute


def _float32() -> torch.dtype:
    import torch

    return torch.float32


@attrs.frozen
class Precision:
    """The weights' dtype and the dtype forward passes autocast to (``None``: no autocast)."""

    param_dtype: torch.dtype = attrs.field(factory=_float32)
    autocast_dtype: torch.dtype | None = None

    @classmethod
    def from_config(cls, fsdp_config: DictConfig) -> Precision:
        import torch

        weights, autocast = dtype_names(fsdp_config)
        return cls(getattr(torch, weights), None if autocast is None else getattr(torch, autocast))

    def autocast(self, device: torch.device) -> AbstractContextManager[object]:
        """The context forward passes run in: autocast to ``autocast_dtype``, or nothing."""
        if self.autocast_dtype is None:
            return nullcontext()
        import torch

        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)
