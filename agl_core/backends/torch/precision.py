"""The torch backend's dtypes, under verl's FSDP engine keys (``actor_rollout_ref.actor.fsdp_config``).

``model_dtype`` is the dtype the weights are loaded, trained and optimised in (verl: the dtype the
transformers model is built in). ``mixed_precision.param_dtype`` is the dtype the forward passes compute
in, by autocast over weights that stay in ``model_dtype`` (verl: FSDP's mixed-precision parameter
dtype, which its engine also autocasts to). Whatever the compute dtype, the log-softmax, log-probs,
log-prob ratios, advantages and the loss are float32 (:mod:`agl_core.backends.torch.model_ops` casts
the logits up), as in verl.

One difference from verl's defaults: verl's FSDP engine computes in bf16 when ``mixed_precision`` is
null; here null means no autocast, so a config that sets nothing trains in float32 as before. fp16 is
refused (it needs loss scaling, which this backend does not do). ``reduce_dtype`` and ``buffer_dtype``
are accepted as fp32 only: one process reduces no gradients across ranks, and buffers are not cast.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import attrs
import torch

from agl_core.config import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["MIXED_PRECISION_KEY", "MODEL_DTYPE_KEY", "Precision", "parse_dtype"]

MODEL_DTYPE_KEY = "actor_rollout_ref.actor.fsdp_config.model_dtype"
MIXED_PRECISION_KEY = "actor_rollout_ref.actor.fsdp_config.mixed_precision"
# verl's names for the dtypes this backend trains in (verl.utils.torch_dtypes.PrecisionType's spellings).
DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
FP16_NAMES = ("fp16", "float16", "16")


def parse_dtype(value: object, key: str) -> torch.dtype:
    """The torch dtype verl's name ``value`` stands for; ``key`` names it in the error."""
    name = str(value).lower()
    if name in FP16_NAMES:
        raise ConfigError(key, "fp16 needs loss scaling, which the torch backend does not do; use bf16 or fp32")
    if name not in DTYPE_NAMES:
        raise ConfigError(key, f"must be one of fp32, bf16 (or float32, bfloat16), got {value!r}")
    return DTYPE_NAMES[name]


@attrs.frozen
class Precision:
    """The weights' dtype and the dtype forward passes autocast to (``None``: no autocast)."""

    param_dtype: torch.dtype = torch.float32
    autocast_dtype: torch.dtype | None = None

    @classmethod
    def from_config(cls, fsdp_config: DictConfig) -> Precision:
        param_dtype = parse_dtype(fsdp_config.model_dtype, MODEL_DTYPE_KEY)
        mixed = fsdp_config.get("mixed_precision")  # verl's own config leaves the key out
        if mixed is None:
            return cls(param_dtype)
        for field in ("reduce_dtype", "buffer_dtype"):
            if parse_dtype(mixed[field], f"{MIXED_PRECISION_KEY}.{field}") != torch.float32:
                raise ConfigError(
                    f"{MIXED_PRECISION_KEY}.{field}",
                    "the torch backend keeps it in fp32 (one process, buffers not cast); set fp32 or leave it out",
                )
        compute = parse_dtype(mixed.param_dtype, f"{MIXED_PRECISION_KEY}.param_dtype")
        if compute == torch.float32 and param_dtype != torch.float32:
            raise ConfigError(
                f"{MIXED_PRECISION_KEY}.param_dtype",
                f"fp32 compute over {MODEL_DTYPE_KEY} bf16 weights is not done; set model_dtype fp32",
            )
        return cls(param_dtype, None if compute in (torch.float32, param_dtype) else compute)

    def autocast(self, device: torch.device) -> AbstractContextManager[object]:
        """The context forward passes run in: autocast to ``autocast_dtype``, or nothing."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)
