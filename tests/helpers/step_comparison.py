"""One optimizer step of a model under test against a reference model's step from the same weights."""

from __future__ import annotations

import torch


def compare_steps(before: dict, after: dict, grads: dict, params: dict) -> dict[str, float]:
    """The weights ``before`` and ``after`` a step under test, and its clipped gradients ``grads`` (by
    parameter name), against the reference ``params`` (stepped from ``before``, their ``.grad``
    clipped): the largest differences of the gradients and of the stepped weights.

    Adam's first step moves a weight by about ``lr`` whatever its gradient, dividing by
    ``|g| + 1e-8``: where ``|g|`` is near that ``eps``, rounding differences of the gradient become
    differences of the step, so ``max_param_diff`` is over the weights whose gradient exceeds 1e-6
    (``n_params_above_1e-6_apart`` counts all those that differ by more than 1e-6)."""
    with torch.no_grad():
        grad = torch.cat([params[k].grad.flatten() for k in after])
        step_diff = torch.cat([(after[k] - params[k]).flatten() for k in after]).abs()
        return {
            "max_grad": float(grad.abs().max()),
            "max_grad_diff": max(float((grads[k] - params[k].grad).abs().max()) for k in after),
            "max_param_change": max(float((after[k] - before[k]).abs().max()) for k in after),
            "max_param_diff": float(step_diff[grad.abs() > 1e-6].max()),
            "n_params": int(grad.numel()),
            "n_params_above_1e-6_apart": int((step_diff > 1e-6).sum()),
        }
