"""A patch of verl 0.9.1's ``maybe_fix_3d_position_ids`` for vision-language rows whose lengths are equal.

verl keeps a row's mrope position ids as ``[4, length]`` and a batch of them as a nested tensor
ragged along its last dimension. TransferQueue hands back rows of one length as a nested tensor
ragged along the *first* row dimension (the 4; values ``[rows * 4, length]``), and verl's
``maybe_fix_3d_position_ids``, run by every worker on what it fetched, then marks the last dimension
ragged without moving the values: the mini-batch selection's ``unbind`` fails with
``split_with_sizes expects split_sizes to sum exactly to <length>``. The patched function first
rebuilds such a tensor ragged along the last dimension (the rows unchanged), then calls verl's.

Applied in every process that imports verl (:mod:`agl_backend_verl.verl_plugins`), whatever the
device: verl's workers import the function by name, so each importing module's name is replaced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["apply", "ragged_along_length", "with_rows_ragged_along_length"]

# verl's modules that import maybe_fix_3d_position_ids by name.
IMPORTERS = ("verl.workers.engine_workers", "verl.workers.engine.base", "verl.workers.engine_workers_tinker")


def ragged_along_length(positions: torch.Tensor) -> torch.Tensor:
    """``positions`` (a batch of ``[k, length]`` rows) as a nested tensor ragged along the length;
    returned as it is unless it is a nested tensor of equal rows ragged along ``k``."""
    if not (positions.is_nested and positions.dim() == 3 and getattr(positions, "_ragged_idx", None) == 1):
        return positions
    values, offsets = positions.values(), positions.offsets()
    rows, sizes = offsets.numel() - 1, offsets.diff()
    if rows == 0 or values.dim() != 2 or not bool((sizes == sizes[0]).all()):
        return positions
    k, length = int(sizes[0]), values.shape[1]
    per_row = values.reshape(rows, k, length)
    return torch.nested.nested_tensor_from_jagged(
        per_row.permute(1, 0, 2).reshape(k, rows * length),
        offsets=torch.arange(rows + 1, device=values.device) * length,
        jagged_dim=2,
    )


def with_rows_ragged_along_length(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """verl's ``maybe_fix_3d_position_ids``, first rebuilding position ids :func:`ragged_along_length`."""

    def maybe_fix_3d_position_ids(data: Any) -> None:
        if "position_ids" in data.keys():
            data["position_ids"] = ragged_along_length(data["position_ids"])
        original(data)

    maybe_fix_3d_position_ids._agl_patch = True  # type: ignore[attr-defined]
    return maybe_fix_3d_position_ids


def apply() -> list[str]:
    """Patch ``verl.utils.tensordict_utils.maybe_fix_3d_position_ids`` where verl's workers read it
    (idempotent); the names replaced."""
    import importlib

    from verl.utils import tensordict_utils

    replaced = []
    if not getattr(tensordict_utils.maybe_fix_3d_position_ids, "_agl_patch", False):
        tensordict_utils.maybe_fix_3d_position_ids = with_rows_ragged_along_length(
            tensordict_utils.maybe_fix_3d_position_ids
        )
        replaced.append("verl.utils.tensordict_utils.maybe_fix_3d_position_ids")
    for name in IMPORTERS:
        try:
            module = importlib.import_module(name)
        except ImportError:  # an engine verl could not import here (its optional dependency is missing)
            continue
        if getattr(module, "maybe_fix_3d_position_ids", None) not in (None, tensordict_utils.maybe_fix_3d_position_ids):
            module.maybe_fix_3d_position_ids = tensordict_utils.maybe_fix_3d_position_ids
            replaced.append(f"{name}.maybe_fix_3d_position_ids")
    return replaced
