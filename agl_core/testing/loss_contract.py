"""The policy-loss contract: what every loss must do with a (micro-)batch of tokens.

Subclass :class:`PolicyLossContract` in a ``test_*.py`` file::

    import my_package
    from agl_core.testing.contracts import PolicyLossContract

    class TestMyLoss(PolicyLossContract):
        loss_name = "my_loss"
        plugins = (my_package,)

The loss is looked up by name and its :class:`~agl_core.stages.policy_loss.PolicyLossSpec` read; set ``clips_ratio =
False`` for a loss that is not PPO-clipped. The properties, on inputs from
:func:`~agl_core.testing.strategies.loss_batches` (float64, NaN in some padded positions):

- the loss is a finite scalar with finite gradients, its metrics finite numbers; padded positions
  reach neither the value nor the gradient;
- zero advantages give a zero policy gradient;
- clipping bounds hold: no gradient through a token whose ratio is past ``1 + clip_ratio_high``
  with a positive advantage, below ``1 - clip_ratio_low`` or past ``clip_ratio_c`` with a negative
  one; inside the bounds the gradient raises the log-prob of a positive advantage and lowers it for
  a negative one;
- the declared normalisation holds: a loss additive over micro-batches (the default) gives, for
  any split of the batch with the whole batch's ``batch_num_tokens``, losses and gradients that
  add up to the whole batch's; a loss declaring ``scale_advantages_per_rollout`` sums its
  per-token terms (it is given advantages already scaled), so a batch repeated twice has twice its loss;
- the input tensors are not changed;
- the loss works in float32 and bfloat16 as in float64 (finite, and close to the float64 value),
  and on huge log-ratios (``|log_prob - old_log_prob|`` up to 800, ``exp`` of which overflows);
- data parallel: the batch split over ``k`` simulated ranks (``dp_size = k``, the whole
  mini-batch's ``batch_num_tokens``), the ranks' gradients averaged as an all-reduce does, gives
  the single-rank loss and gradient.

A loss whose ratio is per sequence (GSPO: ``exp`` of the mean log-ratio of a row's trained
tokens) declares ``ratio_level = "sequence"``: its clip bounds and sides are then checked per
row (rows of one advantage each), instead of per token; nothing else is switched off.
Reference mode: ``reference`` is a slow, obviously-correct loss (same signature); the loss and
its gradient are compared with it on every generated batch.
"""

from __future__ import annotations

from agl_core.testing import hypothesis_missing

try:
    from hypothesis import given
    from hypothesis import strategies as st
except ModuleNotFoundError as exc:
    raise hypothesis_missing(__name__) from exc

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np
import pytest
import torch

from agl_core.errors import UsageError
from agl_core.stages.policy_loss import LossSettings, PolicyLossSpec, policy_loss_spec
from agl_core.testing.lookup import PluginContract
from agl_core.testing.reference import array_diff
from agl_core.testing.snapshots import shorten
from agl_core.testing.strategies import CONTRACT_SETTINGS, LossBatch, loss_batches, loss_settings

__all__ = [
    "Evaluation",
    "PolicyLossContract",
    "check_clip_bounds",
    "check_data_parallel",
    "check_dtypes",
    "check_large_log_ratios",
    "check_matches_reference",
    "check_sequence_clip_bounds",
    "check_finite_and_padding",
    "check_inputs_unchanged",
    "check_micro_batches_add_up",
    "check_sums_tokens",
    "check_zero_advantage_zero_gradient",
    "evaluate",
]

RTOL, ATOL = 1e-6, 1e-9
MARGIN = 1e-6  # ratios this close to a clip bound are not judged


@attrs.frozen
class Evaluation:
    """A loss's value, metrics and gradient with respect to ``log_prob`` on one batch."""

    loss: torch.Tensor
    metrics: Mapping[str, Any]
    grad: torch.Tensor


def _tensors(batch: LossBatch, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor | None]:
    as_tensor = lambda a: None if a is None else torch.tensor(a, dtype=torch.float64).to(dtype)  # noqa: E731
    return {
        "old_log_prob": as_tensor(batch.old_log_prob),
        "log_prob": as_tensor(batch.log_prob).requires_grad_(True),
        "advantages": as_tensor(batch.advantages),
        "response_mask": torch.tensor(batch.response_mask, dtype=torch.bool),
        "rollout_is_weights": as_tensor(batch.rollout_is_weights),
    }


def _call(loss: Any, inputs: Mapping[str, torch.Tensor | None], settings: LossSettings) -> Evaluation:
    value, metrics = loss(
        inputs["old_log_prob"],
        inputs["log_prob"],
        inputs["advantages"],
        inputs["response_mask"],
        settings,
        inputs["rollout_is_weights"],
    )
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        raise AssertionError(f"the loss must be a scalar tensor, got {shorten(value)}")
    grad = torch.autograd.grad(value, inputs["log_prob"], allow_unused=True)[0] if value.requires_grad else None
    return Evaluation(value.detach(), metrics, torch.zeros_like(inputs["log_prob"]) if grad is None else grad)


def evaluate(loss: Any, batch: LossBatch, settings: LossSettings, dtype: torch.dtype = torch.float64) -> Evaluation:
    """Call ``loss`` on ``batch`` (as ``dtype`` tensors) and differentiate it by ``log_prob``."""
    return _call(loss, _tensors(batch, dtype), settings)


def _batch_settings(batch: LossBatch, settings: LossSettings) -> LossSettings:
    """``settings`` for ``batch`` as one mini-batch on one rank: ``batch_num_tokens`` its trained tokens."""
    return attrs.evolve(settings, dp_size=1, batch_num_tokens=batch.n_tokens)


def check_finite_and_padding(loss: Any, batch: LossBatch, settings: LossSettings) -> None:
    """A finite loss, finite metrics and gradients; padded positions reach neither value nor gradient."""
    settings = _batch_settings(batch, settings)
    result = evaluate(loss, batch, settings)
    if not torch.isfinite(result.loss):
        raise AssertionError(
            f"the loss is {result.loss.item()}; expected a finite number (padded positions hold NaN: select, do "
            "not multiply)"
        )
    if not isinstance(result.metrics, Mapping) or not all(np.isfinite(float(v)) for v in result.metrics.values()):
        raise AssertionError(f"metrics {shorten(result.metrics)} should map names to finite floats")
    if not torch.all(torch.isfinite(result.grad)):
        raise AssertionError(f"the gradient by log_prob is not finite: {shorten(result.grad.tolist())}")
    padded = torch.tensor(batch.response_mask == 0)
    if torch.any(result.grad[padded] != 0):
        raise AssertionError(f"untrained positions get gradient {shorten(result.grad[padded].tolist())}; expected 0")
    refilled = _with_padding(batch, -3.0)
    other = evaluate(loss, refilled, settings)
    if not torch.allclose(other.loss, result.loss, rtol=RTOL, atol=ATOL):
        raise AssertionError(
            f"the loss changes from {result.loss.item()} to {other.loss.item()} when only padded positions change"
        )


def _with_padding(batch: LossBatch, value: float) -> LossBatch:
    padding = batch.response_mask == 0

    def refill(array: np.ndarray | None) -> np.ndarray | None:
        if array is None:
            return None
        out = array.copy()
        out[padding] = value
        return out

    return LossBatch(
        *(refill(a) for a in (batch.old_log_prob, batch.log_prob, batch.advantages)),
        batch.response_mask,
        refill(batch.rollout_is_weights),
    )


def check_zero_advantage_zero_gradient(loss: Any, batch: LossBatch, settings: LossSettings) -> None:
    """With every advantage 0 the loss gives no policy gradient."""
    zero = attrs.evolve(batch, advantages=np.where(batch.response_mask == 1, 0.0, batch.advantages))
    grad = evaluate(loss, zero, _batch_settings(batch, settings)).grad
    if torch.any(grad.abs() > ATOL):
        raise AssertionError(
            f"with all advantages 0 the gradient by log_prob is {shorten(grad.tolist())}; expected 0 everywhere"
        )


def check_clip_bounds(loss: Any, batch: LossBatch, settings: LossSettings) -> None:
    """No gradient through a token clipped by ``clip_ratio_low/high`` or the dual clip
    ``clip_ratio_c``; inside the bounds, a gradient that follows the advantage's sign."""
    grad = evaluate(loss, batch, _batch_settings(batch, settings)).grad.numpy()
    trained = batch.response_mask == 1
    with np.errstate(invalid="ignore", over="ignore"):
        ratio = np.exp(np.clip(batch.log_prob - batch.old_log_prob, -20, 20))
    adv, low, high, dual = batch.advantages, 1 - settings.low, 1 + settings.high, settings.clip_ratio_c
    clipped = trained & (
        ((adv > 0) & (ratio > high + MARGIN))
        | ((adv < 0) & (ratio < low - MARGIN))
        | ((adv < 0) & (ratio > dual + MARGIN))
    )
    inside = trained & (np.abs(adv) > MARGIN) & (ratio > low + MARGIN) & (ratio < min(high, dual) - MARGIN)
    for where, why in (
        (clipped & (np.abs(grad) > ATOL), "is clipped yet gets gradient"),
        (
            inside & ~(np.sign(grad) == -np.sign(adv)),
            "is inside the clip bounds yet its gradient does not follow the advantage's sign",
        ),
    ):
        if where.any():
            i, j = (int(k) for k in np.argwhere(where)[0])
            raise AssertionError(
                f"token [{i}, {j}] (ratio {ratio[i, j]:.4g}, advantage {adv[i, j]:.4g}, bounds [{low:.4g}, "
                f"{high:.4g}], "
                f"clip_ratio_c {dual:.4g}) {why}: d loss / d log_prob = {grad[i, j]:.4g}"
            )


def _rows(batch: LossBatch, rows: slice | np.ndarray) -> LossBatch:
    pick = lambda a: None if a is None else a[rows]  # noqa: E731
    return LossBatch(
        *(
            pick(a)
            for a in (
                batch.old_log_prob,
                batch.log_prob,
                batch.advantages,
                batch.response_mask,
                batch.rollout_is_weights,
            )
        )
    )


def check_micro_batches_add_up(loss: Any, batch: LossBatch, settings: LossSettings, cuts: Sequence[int]) -> None:
    """Cut into micro-batches at row indices ``cuts``, with the whole batch's ``batch_num_tokens``,
    the losses and gradients add up to the whole batch's."""
    settings = _batch_settings(batch, settings)
    whole = evaluate(loss, batch, settings)
    bounds = [0, *sorted(set(cuts)), len(batch.response_mask)]
    parts = [evaluate(loss, _rows(batch, slice(a, b)), settings) for a, b in zip(bounds, bounds[1:]) if b > a]
    total = sum(part.loss for part in parts)
    if not torch.allclose(total, whole.loss, rtol=RTOL, atol=ATOL):
        raise AssertionError(
            f"micro-batches cut at rows {bounds[1:-1]} have losses summing to {total.item():.6g}, the whole batch "
            f"{whole.loss.item():.6g}; with settings.batch_num_tokens = {settings.batch_num_tokens} (the mini-batch's) "
            "they must add up, or the update depends on the micro-batch size (declare "
            "additive_over_micro_batches=False if it must)"
        )
    grads = torch.cat([part.grad for part in parts])
    if not torch.allclose(grads, whole.grad, rtol=RTOL, atol=ATOL):
        raise AssertionError(f"micro-batches cut at rows {bounds[1:-1]}: their gradients differ from the whole batch's")


def check_sums_tokens(loss: Any, batch: LossBatch, settings: LossSettings) -> None:
    """A loss given advantages scaled per rollout sums its per-token terms: the batch repeated twice
    (twice the tokens, ``batch_num_tokens`` too) has twice the loss."""
    twice = _rows(batch, np.concatenate([np.arange(len(batch.response_mask))] * 2))
    once = evaluate(loss, batch, _batch_settings(batch, settings)).loss
    doubled = evaluate(loss, twice, _batch_settings(twice, settings)).loss
    if not torch.allclose(doubled, 2 * once, rtol=RTOL, atol=ATOL):
        raise AssertionError(
            f"the batch repeated twice has loss {doubled.item():.6g}, not twice {once.item():.6g}: a loss declaring "
            "scale_advantages_per_rollout gets advantages already divided per rollout and must sum, not "
            "average, its tokens"
        )


def check_inputs_unchanged(loss: Any, batch: LossBatch, settings: LossSettings) -> None:
    """The loss changes none of its input tensors."""
    inputs = _tensors(batch)
    before = {name: None if t is None else t.detach().clone() for name, t in inputs.items()}
    _call(loss, inputs, _batch_settings(batch, settings))
    for name, old in before.items():
        new = inputs[name]
        if old is None:
            continue
        same = (new == old) | (torch.isnan(new.to(torch.float64)) & torch.isnan(old.to(torch.float64)))
        if not torch.all(same):
            i, j = (int(k) for k in torch.nonzero(~same)[0])
            raise AssertionError(
                f"the loss changed its input {name}: [{i}, {j}] was {old[i, j].item()}, now {new[i, j].item()}"
            )


def _per_row_advantages(batch: LossBatch) -> LossBatch:
    """``batch`` with one advantage per row (its first token's) on every trained token."""
    adv = np.where(batch.response_mask == 1, batch.advantages[:, :1], batch.advantages)
    return attrs.evolve(batch, advantages=adv)


def check_sequence_clip_bounds(loss: Any, batch: LossBatch, settings: LossSettings) -> None:
    """Per row (one advantage per row): no gradient through a row whose sequence ratio, ``exp`` of
    the mean log-ratio of its trained tokens, is past ``1 + clip_ratio_high`` with a positive
    advantage or below ``1 - clip_ratio_low`` with a negative one; inside the bounds, the row's
    gradient follows the advantage's sign."""
    batch = _per_row_advantages(batch)
    grad = evaluate(loss, batch, _batch_settings(batch, settings)).grad.numpy()
    trained = batch.response_mask == 1
    log_ratio = np.where(trained, batch.log_prob - batch.old_log_prob, 0.0).sum(axis=1) / trained.sum(axis=1)
    ratio = np.exp(np.clip(log_ratio, -20, 20))
    adv, low, high = batch.advantages[:, 0], 1 - settings.low, 1 + settings.high
    row_grad = np.where(trained, grad, 0.0)
    for i in range(len(ratio)):
        clipped = (adv[i] > 0 and ratio[i] > high + MARGIN) or (adv[i] < 0 and ratio[i] < low - MARGIN)
        inside = abs(adv[i]) > MARGIN and low + MARGIN < ratio[i] < high - MARGIN
        total = row_grad[i].sum()
        why = None
        if clipped and np.abs(row_grad[i]).max() > ATOL:
            why = "is clipped yet gets gradient"
        elif inside and not np.sign(total) == -np.sign(adv[i]):
            why = "is inside the clip bounds yet its gradient does not follow the advantage's sign"
        if why:
            raise AssertionError(
                f"row {i} (sequence ratio {ratio[i]:.4g} = exp(mean log-ratio {log_ratio[i]:.4g}), advantage "
                f"{adv[i]:.4g}, bounds "
                f"[{low:.4g}, {high:.4g}]) {why}: d loss / d log_prob summed over the row = {total:.4g} "
                f"({shorten(row_grad[i].tolist())})"
            )


DTYPE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2}


def check_dtypes(loss: Any, batch: LossBatch, settings: LossSettings) -> None:
    """In float32 and bfloat16 the loss and gradient are finite and close to float64's."""
    settings = _batch_settings(batch, settings)
    exact = evaluate(loss, batch, settings)
    scale = max(1.0, float(exact.loss.abs()))
    for dtype, rtol in DTYPE_TOLERANCE.items():
        result = evaluate(loss, batch, settings, dtype)
        value = float(result.loss.to(torch.float64))
        if not np.isfinite(value) or not torch.all(torch.isfinite(result.grad.to(torch.float64))):
            raise AssertionError(
                f"in {dtype} the loss is {value} and its gradient {shorten(result.grad.tolist())}; expected "
                f"finite (float64: {exact.loss.item():.6g})"
            )
        if abs(value - exact.loss.item()) > rtol * scale * 4:
            raise AssertionError(
                f"in {dtype} the loss is {value:.6g}, in float64 {exact.loss.item():.6g}: more than the dtype's "
                "rounding apart "
                f"(compute in the inputs' dtype, or upcast, but do not lose the value)"
            )


def check_large_log_ratios(loss: Any, batch: LossBatch, settings: LossSettings, log_ratio: float) -> None:
    """With ``log_prob - old_log_prob = log_ratio`` (up to +-800: ``exp`` overflows) on the first
    trained token of every row, the loss and its gradient stay finite, in float64 and float32."""
    new = batch.log_prob.copy()
    new[:, 0] = batch.old_log_prob[:, 0] + log_ratio
    huge = attrs.evolve(batch, log_prob=new)
    for dtype in (torch.float64, torch.float32):
        result = evaluate(loss, huge, _batch_settings(huge, settings), dtype)
        if not torch.isfinite(result.loss) or not torch.all(torch.isfinite(result.grad)):
            raise AssertionError(
                f"with a log-ratio of {log_ratio} on some tokens ({dtype}) the loss is {result.loss.item()} and "
                "its gradient "
                f"{shorten(result.grad.tolist())}; clamp the log-ratio before exp (verl clamps at +-20)"
            )


def check_data_parallel(loss: Any, batch: LossBatch, settings: LossSettings, ranks: int) -> None:
    """Rows dealt round-robin to ``ranks`` simulated ranks (``dp_size = ranks``, the whole batch's
    ``batch_num_tokens``): the ranks' losses and gradients averaged (as an all-reduce does) equal the
    single-rank loss and gradient."""
    ranks = max(1, min(ranks, len(batch.response_mask)))
    single = evaluate(loss, batch, _batch_settings(batch, settings))
    on_rank = attrs.evolve(settings, dp_size=ranks, batch_num_tokens=batch.n_tokens)
    grad = torch.zeros_like(single.grad)
    total = torch.zeros_like(single.loss)
    for r in range(ranks):
        rows = np.arange(r, len(batch.response_mask), ranks)
        part = evaluate(loss, _rows(batch, rows), on_rank)
        grad[rows] = part.grad / ranks
        total = total + part.loss / ranks
    for what, got, want in (("loss", total, single.loss), ("gradient", grad, single.grad)):
        diff = array_diff(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-9)
        if diff:
            raise AssertionError(
                f"on {ranks} ranks (dp_size = {ranks}, batch_num_tokens = {batch.n_tokens} for the whole "
                "mini-batch) the "
                f"all-reduced {what} differs from one rank's: {diff}\n(a data-parallel loss multiplies by "
                "settings.dp_size, "
                "since the ranks' gradients are averaged)"
            )


def check_matches_reference(loss: Any, reference: Any, batch: LossBatch, settings: LossSettings) -> None:
    """The loss's value and gradient equal the reference loss's (a differential property)."""
    settings = _batch_settings(batch, settings)
    got, want = evaluate(loss, batch, settings), evaluate(reference, batch, settings)
    for what, g, w in (("loss", got.loss, want.loss), ("d loss / d log_prob", got.grad, want.grad)):
        diff = array_diff(g.numpy(), w.numpy(), rtol=1e-6, atol=1e-9)
        if diff:
            raise AssertionError(f"{what} differs from the reference's (settings {settings}): {diff}")


class PolicyLossContract(PluginContract):
    """Base test class: subclass it, set ``loss_name`` (and ``plugins``), and pytest runs the contract."""

    registry, name_attribute = "policy_losses", "loss_name"
    loss_name: ClassVar[str] = ""
    #: False for a loss that is not PPO-clipped (its gradient ignores the clip ratios).
    clips_ratio: ClassVar[bool] = True
    #: "token" (PPO: a ratio per token) or "sequence" (GSPO: one ratio per row).
    ratio_level: ClassVar[str] = "token"
    #: a slow, obviously-correct loss to compare with on every generated batch.
    reference: ClassVar[Any] = None

    def spec(self) -> PolicyLossSpec:
        return policy_loss_spec(self.plugin_under_test())

    @given(batch=loss_batches(), settings=loss_settings())
    @CONTRACT_SETTINGS
    def test_loss_and_gradients_are_finite_and_ignore_padding(self, batch, settings):
        check_finite_and_padding(self.spec(), batch, settings)

    @given(batch=loss_batches(), settings=loss_settings())
    @CONTRACT_SETTINGS
    def test_zero_advantage_gives_zero_policy_gradient(self, batch, settings):
        check_zero_advantage_zero_gradient(self.spec(), batch, settings)

    @given(batch=loss_batches(), settings=loss_settings())
    @CONTRACT_SETTINGS
    def test_clipping_bounds_hold(self, batch, settings):
        if not self.clips_ratio:
            pytest.skip("the loss declares it is not PPO-clipped (clips_ratio = False)")
        if self.ratio_level == "sequence":
            check_sequence_clip_bounds(self.spec(), batch, settings)
        elif self.ratio_level == "token":
            check_clip_bounds(self.spec(), batch, settings)
        else:
            raise UsageError(
                f"{type(self).__name__}.ratio_level = {self.ratio_level!r}: expected 'token' or 'sequence'"
            )

    @given(batch=loss_batches(), settings=loss_settings(), data=st.data())
    @CONTRACT_SETTINGS
    def test_declared_normalisation_holds(self, batch, settings, data):
        spec = self.spec()
        if not (spec.additive_over_micro_batches or spec.scale_advantages_per_rollout):
            pytest.skip("the loss declares no normalisation to check")
        if spec.additive_over_micro_batches:
            n = len(batch.response_mask)
            check_micro_batches_add_up(
                spec, batch, settings, data.draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=3), "cuts")
            )
        if spec.scale_advantages_per_rollout:
            check_sums_tokens(spec, batch, settings)

    @given(batch=loss_batches(), settings=loss_settings())
    @CONTRACT_SETTINGS
    def test_input_is_not_mutated(self, batch, settings):
        check_inputs_unchanged(self.spec(), batch, settings)

    @given(batch=loss_batches(), settings=loss_settings())
    @CONTRACT_SETTINGS
    def test_float32_and_bfloat16_agree_with_float64(self, batch, settings):
        check_dtypes(self.spec(), batch, settings)

    @given(
        batch=loss_batches(), settings=loss_settings(), log_ratio=st.sampled_from([-800.0, -60.0, 30.0, 500.0, 800.0])
    )
    @CONTRACT_SETTINGS
    def test_large_log_ratios_stay_finite(self, batch, settings, log_ratio):
        check_large_log_ratios(self.spec(), batch, settings, log_ratio)

    @given(batch=loss_batches(), settings=loss_settings(), ranks=st.integers(2, 4))
    @CONTRACT_SETTINGS
    def test_data_parallel_ranks_add_up_to_one(self, batch, settings, ranks):
        check_data_parallel(self.spec(), batch, settings, ranks)

    @given(batch=loss_batches(), settings=loss_settings())
    @CONTRACT_SETTINGS
    def test_matches_the_reference(self, batch, settings):
        if type(self).reference is None:
            pytest.skip("no reference loss given (reference = None)")
        check_matches_reference(self.spec(), type(self).reference, batch, settings)
