"""The numeric part of ``scripts/device_check.py``: losses, estimators and verl's loss on a device.

Each check returns a JSON-ready dict with ``status`` (``passed``, ``failed`` or, for verl only,
``unavailable``) and every comparison it made, with the tolerance it was held to.

* **Losses.** Every registered policy loss runs on the device in float32 and in bfloat16 and is
  compared with the same loss in float64 on the CPU, both from the same inputs rounded to the dtype
  under test (so what is measured is the device's arithmetic, not the rounding of the inputs): the
  loss, its gradient with respect to ``log_prob`` and its metrics (see :func:`check_losses`).
* **Estimators.** The estimators run on the host in float64 numpy and hand float32 arrays over;
  the device only ever receives those values. The check runs every registered estimator on grouped
  rollouts, moves its advantages to the device as the torch backend does (float32, then the dtype
  under test) and compares them with the documented closed forms in float64. A registered estimator
  without a closed form here is listed as unchecked.
* **verl.** Where verl 0.9.1's ``verl.workers.utils.losses.ppo_loss`` imports (it needs Ray: verl's
  ``protocol`` and ``single_controller`` modules import it), agl's losses registered by
  ``agl_backend_verl.verl_plugins`` are run through it on the same device batches and compared with
  the torch backend's direct call, and ``token_mean`` with verl's own ``vanilla`` loss. Where it does
  not import, the result holds the import error and which of the modules verl's loss path needs are
  missing.
"""

from __future__ import annotations

import importlib.util
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from agl_core.data import TrainingRow
from agl_core.plugins import PluginManager
from agl_core.stages.advantage import AdvantageSettings
from agl_core.stages.policy_loss import LossSettings
from agl_core.stages.tensorize import pad_responses

__all__ = ["TOLERANCES", "check_estimators", "check_losses", "check_verl"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Largest accepted error per dtype (relative, see the module docstring; metrics: absolute).
TOLERANCES = {
    "float32": {"loss": 1e-5, "grad": 1e-5, "metric": 1e-5, "advantage": 1e-6},
    "bfloat16": {"loss": 5e-3, "grad": 5e-2, "metric": 5e-2, "advantage": 5e-3},
}
PROMPT = 3  # prompt tokens per row of the verl micro-batch
SETTINGS = LossSettings(clip_ratio=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
EPSILON = AdvantageSettings().epsilon
# The top-level modules verl 0.9.1's loss path imports beyond torch, numpy, transformers and their
# dependencies (found by importing it with each left out in turn).
VERL_LOSS_MODULES = (
    "ray", "tensordict", "pyvers", "cloudpickle", "codetiming", "orjson", "msgpack", "requests", "urllib3",
    "jsonschema", "referencing", "rpds", "jsonschema_specifications", "datasets", "multiprocess", "pandas",
    "dateutil", "dill", "xxhash", "omegaconf", "antlr4",
)  # fmt: skip


def loss_batch(seed: int, rows: int, width: int) -> dict[str, torch.Tensor]:
    """float64 CPU inputs of a policy loss: log-probs a PPO step apart, advantages, importance weights,
    and a mask with untrained observation tokens inside each response and right padding after it."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=g)
    mask = (torch.rand(rows, width, generator=g, dtype=torch.float64) < 0.8) & (torch.arange(width) < lengths[:, None])
    mask[:, 0] = True
    old = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 4
    return {
        "old_log_prob": old,
        "log_prob": old + (torch.rand(rows, width, generator=g, dtype=torch.float64) - 0.5) * 0.8,
        "advantages": torch.randn(rows, width, generator=g, dtype=torch.float64),
        "response_mask": mask,
        "rollout_is_weights": torch.rand(rows, width, generator=g, dtype=torch.float64) + 0.5,
        "lengths": lengths,
    }


def _rounded(batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``batch`` with its floating-point inputs rounded to ``dtype`` (kept in float64)."""
    return {k: v.to(dtype).double() if v.is_floating_point() else v for k, v in batch.items()}


def _loss_inputs(batch: dict[str, torch.Tensor], device: str, dtype: torch.dtype, weighted: bool) -> list[Any]:
    cast = [batch[k].to(device, dtype) for k in ("old_log_prob", "log_prob", "advantages")]
    weights = batch["rollout_is_weights"].to(device, dtype) if weighted else None
    return [*cast, batch["response_mask"].to(device), SETTINGS, weights]


def _run_loss(fn: Callable[..., Any], inputs: list[Any]) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The loss, its gradient with respect to ``log_prob`` (both float64 on the CPU) and its metrics."""
    log_prob = inputs[1].detach().requires_grad_(True)
    loss, metrics = fn(inputs[0], log_prob, *inputs[2:])
    loss.backward()
    return loss.detach().double().cpu(), log_prob.grad.double().cpu(), metrics


def _relative(value: torch.Tensor, reference: torch.Tensor, scale: float) -> float:
    return float((value - reference).abs().max()) / max(scale, 1e-12)


def _loss_scale(fn: Callable[..., Any], inputs: list[Any]) -> float:
    """The loss's magnitude: the same loss with ``|advantages|``, whose terms cannot cancel."""
    return float(fn(inputs[0], inputs[1], inputs[2].abs(), *inputs[3:])[0].abs())


def check_losses(
    device: str, plugins: PluginManager | None = None, rows: int = 16, width: int = 64, seeds: int = 3
) -> dict[str, Any]:
    """Every registered loss on the device against float64 on the CPU, from the same inputs rounded
    to the dtype under test: the loss (relative to its magnitude), the gradient (relative L1 error:
    a token whose ratio sits on a clip bound may flip sides under rounding, which a max-norm would
    count as a whole token's gradient) and the metrics (absolute)."""
    results = []
    for entry in (plugins or PluginManager()).policy_losses.entries():
        for seed in range(seeds):
            weighted = seed % 2 == 1
            for dtype_name, dtype in DTYPES.items():
                batch = _rounded(loss_batch(seed, rows, width), dtype)
                exact = _loss_inputs(batch, "cpu", torch.float64, weighted)
                reference = _run_loss(entry.obj, exact)
                loss, grad, metrics = _run_loss(entry.obj, _loss_inputs(batch, device, dtype, weighted))
                errors = {
                    "loss": float((loss - reference[0]).abs()) / max(_loss_scale(entry.obj, exact), 1e-12),
                    "grad": float((grad - reference[1]).abs().sum() / reference[1].abs().sum().clamp(min=1e-12)),
                    "metric": max((abs(metrics[k] - v) for k, v in reference[2].items()), default=0.0),
                }
                results.append(
                    {
                        "loss": entry.name, "dtype": dtype_name, "seed": seed, "weighted": weighted,
                        "loss_value": float(loss), "reference": float(reference[0]), "errors": errors,
                        "passed": all(errors[k] <= TOLERANCES[dtype_name][k] for k in errors),
                    }
                )  # fmt: skip
    return _summary(results, rows=rows, width=width)


def _closed_forms(norm: bool) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
    """The documented formulas of the built-in estimators for one group's rewards (float64); with
    ``gamma = 1`` and only final rewards ``turn_grpo`` is ``grpo``."""

    def grpo(r: np.ndarray) -> np.ndarray:
        centred = r - r.mean() if np.ptp(r) else np.zeros_like(r)
        return centred / (r.std(ddof=1) + EPSILON) if norm else centred

    return {
        "grpo": grpo,
        "turn_grpo": grpo,
        "rloo": lambda r: (r - r.mean()) * len(r) / (len(r) - 1) if np.ptp(r) else np.zeros_like(r),
        "reinforce": lambda r: r,
        "reinforce_baseline": lambda r: r - r.mean() if np.ptp(r) else np.zeros_like(r),
    }


def estimator_rows(seed: int, groups: int = 6, n: int = 4, width: int = 24) -> list[TrainingRow]:
    """One row per rollout, ``n`` rollouts per group; rewards tied (zero-variance groups) or spread
    over several orders of magnitude."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(groups):
        scale = 10.0 ** rng.integers(-3, 4)
        tied = g % 3 == 0
        for r in range(n):
            length = int(rng.integers(1, width + 1))
            mask = (rng.random(length) < 0.8).astype(np.int8)
            mask[0] = 1
            reward = float(scale) if tied else float(rng.normal() * scale)
            rows.append(
                TrainingRow(
                    prompt_ids=[1], response_ids=np.full(length, 2), response_mask=mask, reward=reward,
                    rollout_id=f"g{g}r{r}", group_id=f"g{g}", response_turns=np.zeros(length, dtype=np.int64),
                )
            )  # fmt: skip
    return rows


def check_estimators(device: str, plugins: PluginManager | None = None, seeds: int = 3) -> dict[str, Any]:
    results, unchecked = [], []
    for entry in (plugins or PluginManager()).advantage_estimators.entries():
        for norm in (True, False):
            closed_form = _closed_forms(norm).get(entry.name)
            if closed_form is None:
                unchecked.append(entry.name)
                break
            for seed in range(seeds):
                rows = estimator_rows(seed)
                width = max(len(row.response_ids) for row in rows)
                per_rollout: dict[str, float] = {}
                for group in dict.fromkeys(row.group_id for row in rows):
                    members = [row for row in rows if row.group_id == group]
                    values = closed_form(np.array([row.reward for row in members]))
                    per_rollout.update(zip((row.rollout_id for row in members), values.tolist()))
                expected = [per_rollout[row.rollout_id] * row.response_mask.astype(np.float64) for row in rows]
                reference = pad_responses(expected, width, torch.float64)
                estimated = entry.obj(rows, AdvantageSettings(norm_adv_by_std=norm)).per_row
                advantages = pad_responses(estimated, width, torch.float32)
                scale = max(float(reference.abs().max()), 1.0)
                for dtype_name, dtype in DTYPES.items():
                    on_device = advantages.to(device).to(dtype)
                    error = _relative(on_device.double().cpu(), reference, scale)
                    results.append(
                        {
                            "estimator": entry.name, "norm_adv_by_std": norm, "dtype": dtype_name, "seed": seed,
                            "errors": {"advantage": error}, "passed": error <= TOLERANCES[dtype_name]["advantage"],
                        }
                    )  # fmt: skip
    return {**_summary(results), "unchecked": unchecked}


def _summary(results: list[dict[str, Any]], **shape: Any) -> dict[str, Any]:
    worst: dict[str, dict[str, float]] = {}
    for result in results:
        for name, error in result["errors"].items():
            worst.setdefault(result["dtype"], {})[name] = max(worst.get(result["dtype"], {}).get(name, 0.0), error)
    return {
        "status": "passed" if results and all(r["passed"] for r in results) else "failed",
        "tolerances": {dtype: {k: TOLERANCES[dtype][k] for k in errors} for dtype, errors in worst.items()},
        "worst_errors": worst,
        "n_comparisons": len(results),
        "failures": [r for r in results if not r["passed"]][:10],
        **shape,
    }


def check_verl(device: str, rows: int = 16, width: int = 64, seeds: int = 2) -> dict[str, Any]:
    try:
        from verl.trainer.ppo.core_algos import get_policy_loss_fn
        from verl.workers.config import ActorConfig, PolicyLossConfig
        from verl.workers.utils.losses import ppo_loss  # first: an import error is then verl's own

        import agl_backend_verl.verl_plugins as verl_plugins
    except Exception:
        missing = [m for m in VERL_LOSS_MODULES if importlib.util.find_spec(m) is None]
        return {"status": "unavailable", "import_error": traceback.format_exc(limit=-6), "missing_modules": missing}
    import verl

    results = []
    for name in verl_plugins.REGISTERED["policy_losses"]:
        verl_plugins.ensure_registered(name)
        direct = PluginManager().policy_losses.get(name)
        for seed, (dtype_name, dtype) in ((s, d) for s in range(seeds) for d in DTYPES.items()):
            batch = loss_batch(100 + seed, rows, width)
            old, new, adv, mask, settings, _ = _loss_inputs(batch, device, dtype, weighted=False)
            config = ActorConfig(
                strategy="fsdp", ppo_mini_batch_size=rows, ppo_micro_batch_size_per_gpu=rows, rollout_n=1,
                clip_ratio=settings.clip_ratio, clip_ratio_low=settings.low, clip_ratio_high=settings.high,
                clip_ratio_c=settings.clip_ratio_c, loss_agg_mode="token-mean",
                policy_loss=PolicyLossConfig(loss_mode=name),
            )  # fmt: skip
            log_probs, data = verl_micro_batch(old, new, adv, mask, batch["lengths"].to(device))
            through_verl = float(ppo_loss(config, {"log_probs": log_probs}, data)[0])
            torch_backend = float(direct(old, new, adv, mask, SETTINGS)[0])
            magnitude = _loss_scale(direct, [old, new, adv, mask, SETTINGS])
            comparisons = {"verl_ppo_loss_vs_torch_backend": abs(through_verl - torch_backend) / magnitude}
            if name == "token_mean":
                vanilla = float(get_policy_loss_fn("vanilla")(old, new, adv, mask, "token-mean", config, None)[0])
                comparisons["verl_vanilla_vs_token_mean"] = abs(vanilla - torch_backend) / magnitude
            error = max(comparisons.values())
            results.append(
                {
                    "loss": name, "dtype": dtype_name, "seed": seed, "errors": {"loss": error},
                    "comparisons": comparisons,
                    "passed": error <= TOLERANCES[dtype_name]["loss"],
                }
            )  # fmt: skip
    return {
        **_summary(results, rows=rows, width=width),
        "verl": verl.__version__,
        "registered": verl_plugins.REGISTERED,
    }


def verl_micro_batch(
    old: torch.Tensor, new: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, Any]:
    """What verl's actor hands ``ppo_loss``: the model's log-probs flat over the real tokens (each
    response token's at the position before it), and the micro-batch in verl's padded layout (a
    prompt of ``PROMPT`` tokens, responses right-padded to their lengths) with its global batch info."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    rows, width = new.shape
    device = new.device
    before = new.new_zeros(PROMPT - 1)
    log_probs = torch.cat([torch.cat([before, new[i, : lengths[i]], new.new_zeros(1)]) for i in range(rows)])
    real = (torch.arange(width, device=device) < lengths[:, None]).long()
    tensors = {
        "prompts": torch.ones(rows, PROMPT, dtype=torch.long, device=device),
        "responses": torch.ones(rows, width, dtype=torch.long, device=device),
        "attention_mask": torch.cat([torch.ones(rows, PROMPT, dtype=torch.long, device=device), real], dim=1),
        "response_mask": mask.long(),
        "old_log_probs": old,
        "advantages": adv,
    }
    data = TensorDict(tensors, batch_size=[rows])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=rows)
    return log_probs, data
