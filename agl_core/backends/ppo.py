"""The PPO update a loop backend composes: what its model computes from the rows, and one optimizer
step of verl's actor update on it. The torch backend (:mod:`agl_core.backends.torch.update`) and
``examples/ddp_backend`` are both written with it; ``docs/architecture.md`` ("The update toolkit")
states the formulas that the backend contract checks a backend's update against.

What the model computes (:func:`response_stats`): the log-prob of each response token and the entropy
of the distribution it was drawn from, as :class:`ResponseStats`, without a ``[rows, response_len,
vocab]`` tensor. The model's forward runs with its output head applied to nothing: the hidden states
the head would read are taken where a response token is predicted (``logits_to_keep``: for padded
rows the last ``response_len + 1`` columns, for rows packed with their shared prefixes the columns
their :class:`~agl_core.backends.micro_batching.PackedForward` keeps, which each row reads
through the pass's ``index``). Then the head is applied, under the autocast the forward would have
applied it under, to :data:`CHUNK_BYTES` of logits at a time, each chunk recomputed in the backward
pass (:func:`head_stats`), its log-softmax in float32 (float64 for a float64 model). A model that
transforms its head's output into its logits (softcapping, a logit scale) is refused
(:func:`check_output_head`).

The optimizer (:func:`make_optimizer`, :func:`lr_schedule`): AdamW over the trainable parameters and
verl's learning-rate schedules, as ``actor_rollout_ref.actor.optim`` says.

The update (:func:`train_batch`, :class:`ActorStep`, written once for every loop backend, each
supplying its forward and, in several processes, how they meet, :class:`DataParallel`; the parts:
:func:`mini_batches`, :func:`frozen_log_probs`, :func:`ppo_loss`, :func:`optimizer_step`,
:func:`step_metrics`, :func:`mean_over_steps`): the policy loss −
``entropy_coeff`` × the entropy (+ ``kl_loss_coef`` × the low-variance KL to the reference policy),
the entropy and KL being token means over the mini-batch (``LossSettings.batch_num_tokens``,
``dp_size``); gradients clipped at ``grad_clip``, the step skipped and counted when their norm is not
finite; the loss terms of a step's parts (micro-batches, data-parallel ranks) add up, its other
metrics are token-weighted means, and an update's metrics are means over its optimizer steps, counts
summed.

Vision-language rows (:func:`agl_core.stages.tensorize.tensorize` with a ``VisionSpec``) carry
``position_ids`` as ``[rows, 4, L]`` (verl's layout: text positions, then mrope's temporal, height and
width ones), which the model takes as ``[4, rows, L]``, and their images under
:data:`~agl_core.backends.micro_batching.MULTI_MODAL_INPUTS`: one dict per row, whose ``pixel_values``
and ``image_grid_thw`` the forward concatenates in row order, the order their placeholder tokens have
in the flattened batch.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch
import torch.utils.checkpoint

from agl_core.backends.micro_batching import MULTI_MODAL_INPUTS, MiniBatch, PackedForward, UpdateBatch, row_groups
from agl_core.config import ConfigError
from agl_core.errors import UsageError
from agl_core.stages.policy_loss import LossSettings, PolicyLoss, batch_token_mean, policy_loss_spec

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = [
    "ADDITIVE_METRICS",
    "CHUNK_BYTES",
    "LOGIT_TRANSFORMS",
    "MULTI_MODAL_INPUTS",
    "UPDATE_KEYS",
    "ActorLoss",
    "ActorStep",
    "DataParallel",
    "ResponseStats",
    "attention_implementation",
    "check_output_head",
    "check_splittable",
    "frozen_log_probs",
    "has_images",
    "head_stats",
    "low_var_kl",
    "lr_lambda",
    "lr_schedule",
    "make_optimizer",
    "mean_over_steps",
    "micro_batches",
    "mini_batches",
    "model_attention_mask",
    "model_inputs",
    "optimizer_step",
    "ppo_loss",
    "rank_rows",
    "response_log_probs",
    "response_stats",
    "step_metrics",
    "take_rows",
    "train_batch",
    "trainable_parameters",
]

ADDITIVE_METRICS = frozenset({"actor/pg_loss", "actor/entropy_loss", "actor/kl_loss", "actor/loss"})
"""The loss terms: a step's parts add up to them; every other metric of a step is a token mean."""


UPDATE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
"""The padded text tensors (:func:`~agl_core.stages.tensorize.tensorize`) a PPO update reads."""


def take_rows(tensors: Mapping[str, torch.Tensor], rows: slice | Sequence[int]) -> dict[str, torch.Tensor]:
    """The :data:`UPDATE_KEYS` tensors of ``rows`` (a slice, or row indices) of a padded batch."""
    return {name: tensors[name][rows] for name in UPDATE_KEYS}


def has_images(tensors: Mapping[str, Any]) -> bool:
    """Whether a row of the batch has images."""
    rows = tensors.get(MULTI_MODAL_INPUTS)
    return rows is not None and any(row for row in rows)


def model_inputs(tensors: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The forward's inputs of a padded batch: ids, mask, positions (mrope ones as ``[4, rows, L]``)
    and its rows' images, concatenated in row order."""
    positions = tensors["position_ids"]
    inputs = {
        "input_ids": tensors["input_ids"],
        "attention_mask": tensors["attention_mask"],
        "position_ids": positions.transpose(0, 1) if positions.ndim == 3 else positions,
    }
    rows = [row for row in np.asarray(tensors.get(MULTI_MODAL_INPUTS, ())).tolist() if row]
    if rows:
        device = inputs["input_ids"].device
        for name in ("pixel_values", "image_grid_thw"):
            inputs[name] = torch.cat([torch.as_tensor(row[name]) for row in rows]).to(device)
    return inputs


def attention_implementation(model: torch.nn.Module) -> str | None:
    """The attention implementation of ``model``, or of the model a ``DistributedDataParallel`` wraps."""
    return getattr(getattr(model, "module", model).config, "_attn_implementation", None)


def model_attention_mask(model: torch.nn.Module, mask: torch.Tensor | None) -> torch.Tensor | None:
    """A 4-D boolean mask (True: attend) as the model's attention applies it. ``sdpa`` takes it as it
    is; ``eager`` adds its mask to the attention scores, so it gets 0 where a token attends and the
    lowest value of the model's dtype elsewhere (a boolean mask added to the scores masks nothing)."""
    if mask is None or attention_implementation(model) != "eager":
        return mask
    dtype = next(model.parameters()).dtype
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def padded_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Padded rows' 4-D causal mask ``[rows, 1, L, L]`` in which a padding token attends to itself.
    Given the 2-D mask, transformers' eager attention leaves a left-padding token attending to nothing:
    its softmax in float64 is NaN, and the NaN reaches every real token through the zero weights."""
    valid = attention_mask.bool()
    length = valid.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    itself = torch.eye(length, dtype=torch.bool, device=valid.device)
    return ((causal & valid[:, None, :]) | itself)[:, None]


CHUNK_BYTES = 128 * 2**20
"""The float32 logits one chunk of :func:`head_stats` computes at a time (its softmax and their gradients
take a few times as much while the chunk is computed): 682 positions of a 49,152-token vocabulary."""

#: ``config`` attributes by which a model family turns its output head's result into its logits
#: (Gemma's softcapping, Cohere's and Granite's scales, Falcon-H1's multiplier), with the value at
#: which the logits are the head's.
LOGIT_TRANSFORMS = {
    "final_logit_softcapping": None,
    "logit_scale": 1.0,
    "logits_scaling": 1.0,
    "lm_head_multiplier": 1.0,
}


@attrs.frozen
class ResponseStats:
    """The policy at each response token of each row, ``[rows, response_len]`` (float32, or float64
    for a float64 model); past a row's response, values of no token."""

    log_prob: torch.Tensor
    """The log-prob of the row's token."""
    entropy: torch.Tensor
    """The entropy of the distribution the token was drawn from."""


def check_output_head(model: torch.nn.Module) -> torch.nn.Module:
    """``model``'s output head (of the model a ``DistributedDataParallel`` wraps), refused, naming the
    ``config`` attribute, when the model's logits are not the head's output (:data:`LOGIT_TRANSFORMS`)."""
    model = getattr(model, "module", model)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        for name, plain in LOGIT_TRANSFORMS.items():
            value = getattr(config, name, plain)
            if value != plain:
                raise ConfigError(
                    "actor_rollout_ref.model.path",
                    f"a {config.model_type!r} model with {name}={value!r} transforms its output head's result"
                    " into its logits, which agl's chunked log-probs do not compute; use a model without it",
                )
    head = model.get_output_embeddings()
    if head is None:
        raise ConfigError("actor_rollout_ref.model.path", f"a {model.config.model_type!r} model has no output head")
    return head


def head_input(
    model: torch.nn.Module, head: torch.nn.Module, inputs: Mapping[str, Any], logits_to_keep: int | torch.Tensor
) -> tuple[torch.Tensor, torch.autocast]:
    """The hidden states ``model``'s output ``head`` reads at the ``logits_to_keep`` columns of a forward
    on ``inputs``, the head itself applied to none of them (no logits are computed), and the autocast
    it would have run under (a wrapper such as accelerate's may autocast inside the forward only)."""
    seen: list[tuple[torch.Tensor, torch.autocast]] = []

    def take(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        device = args[0].device.type
        enabled, dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        seen.append((args[0], torch.autocast(device, dtype=dtype, enabled=enabled)))
        return (args[0][..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(take)
    try:
        model(**inputs, use_cache=False, logits_to_keep=logits_to_keep)
    finally:
        handle.remove()
    if len(seen) != 1:
        raise UsageError(f"the model's forward called its output head {len(seen)} times; agl reads it once")
    return seen[0]


def response_hidden(
    model: torch.nn.Module, head: torch.nn.Module, tensors: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.autocast]:
    """The head's hidden states at the positions predicting padded rows' response tokens,
    ``[rows, response_len, hidden]``, and their autocast (:func:`head_input`)."""
    width = tensors["responses"].shape[1]
    inputs = model_inputs(tensors)
    if attention_implementation(model) == "eager":
        inputs["attention_mask"] = model_attention_mask(model, padded_attention_mask(inputs["attention_mask"]))
    hidden, autocast = head_input(model, head, inputs, width + 1)
    return hidden[:, :-1], autocast


def packed_hidden(
    model: torch.nn.Module, head: torch.nn.Module, packed: PackedForward
) -> tuple[torch.Tensor, torch.autocast]:
    """The head's hidden states at the columns ``packed`` keeps of each of its packs,
    ``[packs × kept columns, hidden]`` (what ``packed.index`` points into), and their autocast."""
    inputs = {
        "input_ids": packed.input_ids,
        "attention_mask": model_attention_mask(model, packed.attention_mask),
        "position_ids": packed.position_ids,
    }
    hidden, autocast = head_input(model, head, inputs, packed.keep)
    return hidden.flatten(0, 1), autocast


def chunk_stats(
    head: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probs of ``tokens`` at ``positions`` of a chunk of hidden states, and the entropy at each
    of its positions: one log-softmax over the chunk's logits, in at least float32."""
    logits = head(hidden)
    log_probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
    return log_probs[positions, tokens], -(log_probs.exp() * log_probs).sum(-1)


def head_stats(head: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, tokens: torch.Tensor) -> ResponseStats:
    """:class:`ResponseStats` of the rows whose token ``tokens[r, t]`` is predicted from
    ``hidden[index[r, t]]`` (``hidden`` ``[positions, hidden size]``), ``head`` applied to
    :data:`CHUNK_BYTES` of logits at a time, each chunk recomputed for the backward pass: a pass holds
    one chunk's logits, never every position's."""
    flat = index.flatten()
    order = flat.argsort(stable=True)
    positions, tokens = flat[order], tokens.flatten()[order]
    size = max(1, CHUNK_BYTES // (4 * head.weight.shape[0]))
    starts = list(range(0, hidden.shape[0], size))
    bounds = torch.searchsorted(positions, torch.tensor([*starts, hidden.shape[0]], device=positions.device)).tolist()
    parts = [
        torch.utils.checkpoint.checkpoint(
            chunk_stats,
            head,
            hidden[start : start + size],
            positions[first:last] - start,
            tokens[first:last],
            use_reentrant=False,
        )
        for start, first, last in zip(starts, bounds, bounds[1:])
    ]
    chosen, entropy = (torch.cat(values) for values in zip(*parts))
    return ResponseStats(log_prob=chosen[order.argsort()].view(index.shape), entropy=entropy[index])


def response_stats(
    model: torch.nn.Module, tensors: Mapping[str, Any], packed: PackedForward | None = None
) -> ResponseStats:
    """:class:`ResponseStats` of the response tokens under ``model``: from the padded rows, or from
    ``packed`` (the same rows with their shared prefixes computed once). The head is applied under the
    autocast the model's forward would have applied it under."""
    head = check_output_head(model)
    if packed is None:
        hidden, autocast = response_hidden(model, head, tensors)
        index = torch.arange(hidden.shape[0] * hidden.shape[1], device=hidden.device).view(hidden.shape[:2])
        hidden = hidden.flatten(0, 1)
    else:
        (hidden, autocast), index = packed_hidden(model, head, packed), packed.index
    with autocast:
        return head_stats(head, hidden, index, tensors["responses"])


def response_log_probs(
    model: torch.nn.Module, tensors: Mapping[str, Any], packed: PackedForward | None = None
) -> torch.Tensor:
    """Log-probs of the response tokens under ``model``, ``[rows, response_len]``
    (:func:`response_stats`)."""
    return response_stats(model, tensors, packed).log_prob


def frozen_log_probs(
    model: torch.nn.Module, tensors: Mapping[str, Any], packed: PackedForward | None = None
) -> torch.Tensor:
    """:func:`response_log_probs` of a policy that is not being stepped (the old log-probs of the policy
    before an update, a reference policy's): under ``eval()`` and ``no_grad``, the model then back in
    the mode it was in."""
    training = model.training
    with torch.no_grad():
        model.eval()
        try:
            return response_log_probs(model, tensors, packed)
        finally:
            model.train(training)


def low_var_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(policy ‖ reference) per token, clamped as verl does."""
    diff = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)
    return torch.clamp(torch.exp(diff) - diff - 1, min=-10, max=10)


# -- the optimizer -----------------------------------------------------------------------------------


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters an update trains: all of them, or a LoRA model's adapter weights."""
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(model: torch.nn.Module, optim: DictConfig) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters as ``actor_rollout_ref.actor.optim`` says."""
    return torch.optim.AdamW(
        trainable_parameters(model),
        lr=float(optim.lr),
        betas=tuple(optim.betas),
        weight_decay=float(optim.weight_decay),
    )


def lr_lambda(optim: DictConfig, total_steps: int) -> Callable[[int], float]:
    """verl's schedules: linear warmup over ``lr_warmup_steps``, then constant or cosine down to
    ``min_lr_ratio``."""
    kind = optim.lr_scheduler_type
    if kind not in ("constant", "cosine"):
        raise ConfigError(
            "actor_rollout_ref.actor.optim.lr_scheduler_type", f"must be constant or cosine, got {kind!r}"
        )
    warmup = max(0, int(optim.lr_warmup_steps))
    floor = float(optim.min_lr_ratio)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def lr_schedule(
    optimizer: torch.optim.Optimizer, optim: DictConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``optimizer``'s learning rate over ``total_steps`` updates (:func:`lr_lambda`), stepped once per update."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, total_steps))


# -- one optimizer step ----------------------------------------------------------------------------


def mini_batches(n_rows: int, n_mini_batches: int) -> list[slice]:
    """The rows of each of a batch's ``n_mini_batches`` mini-batches: consecutive slices of equal size
    (the step pipeline shapes a batch so that they divide it)."""
    size = n_rows // n_mini_batches
    return [slice(start, start + size) for start in range(0, n_rows, size)]


def micro_batches(rows: Sequence[int], size: int | None) -> list[Sequence[int]]:
    """Deprecated: :func:`agl_core.backends.micro_batching.row_groups`, where the batch module keeps it."""
    warnings.warn(
        "agl_core.backends.ppo.micro_batches moved to agl_core.backends.micro_batching.row_groups",
        DeprecationWarning,
        stacklevel=2,
    )
    return row_groups(rows, size)


def check_splittable(loss_fn: PolicyLoss, key: str, parts: str) -> None:
    """Refuse, naming ``key``, to cut a mini-batch's loss into ``parts`` (micro-batches, data-parallel
    processes' shares) whose gradients are added up, for a policy loss that declares
    ``additive_over_micro_batches=False``: the sum would not be the mini-batch's gradient."""
    if not policy_loss_spec(loss_fn).additive_over_micro_batches:
        raise ConfigError(
            key,
            f"the policy loss declares additive_over_micro_batches=False, so {parts} would change its update",
        )


def rank_rows(rows: slice, rank: int, world: int) -> list[int]:
    """The rows of a mini-batch that data-parallel rank ``rank`` of ``world`` trains: every
    ``world``-th from its ``rank``-th (its loss is then its share of the mini-batch's, ``dp_size=world``)."""
    return list(range(rows.start + rank, rows.stop, world))


def ppo_loss(
    loss_fn: PolicyLoss,
    settings: LossSettings,
    stats: ResponseStats,
    rows: Mapping[str, Any],
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    entropy_coeff: float = 0.0,
    ref_log_prob: torch.Tensor | None = None,
    kl_loss_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's actor loss on ``rows`` (their ``response_mask``) from the policy's ``stats`` at their
    response tokens (:func:`response_stats`), and its metrics: ``loss_fn``'s loss − ``entropy_coeff`` ×
    the entropy, + ``kl_loss_coef`` × the KL to the reference when ``ref_log_prob`` is given; the
    entropy and the KL are token means under ``settings`` (verl's ``agg_loss`` ``token-mean``),
    whatever the policy loss's own reduction. The entropy carries no gradient when ``entropy_coeff``
    is 0 (it is only reported)."""
    mask = rows["response_mask"]
    pg_loss, pg_metrics = loss_fn(old_log_prob, stats.log_prob, advantages, mask, settings)
    entropy = batch_token_mean(stats.entropy if entropy_coeff > 0 else stats.entropy.detach(), mask, settings)
    loss = pg_loss - entropy_coeff * entropy
    metrics = {**pg_metrics, "actor/pg_loss": pg_loss.item(), "actor/entropy_loss": entropy.item()}
    if ref_log_prob is not None:
        kl = batch_token_mean(low_var_kl(stats.log_prob, ref_log_prob), mask, settings)
        loss = loss + kl_loss_coef * kl
        metrics.update({"actor/kl_loss": kl.item(), "actor/kl_coef": kl_loss_coef})
    metrics["actor/loss"] = loss.item()
    return loss, metrics


def optimizer_step(
    optimizer: torch.optim.Optimizer, parameters: Iterable[torch.nn.Parameter], grad_clip: float
) -> dict[str, float]:
    """Clip the accumulated gradients of ``parameters`` to norm ``grad_clip`` and step ``optimizer``,
    unless the norm is not finite: that step is skipped and counted (``actor/n_skipped_nonfinite_grad``)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
    metrics = {"actor/grad_norm": float(grad_norm)}
    if torch.isfinite(grad_norm):
        optimizer.step()
    else:
        metrics["actor/n_skipped_nonfinite_grad"] = 1.0
    return metrics


def step_metrics(parts: Iterable[tuple[Mapping[str, float], float]], additive_scale: float = 1.0) -> dict[str, float]:
    """One optimizer step's metrics from its parts' ``(metrics, trained tokens)`` (micro-batches, or
    data-parallel ranks): the loss terms (:data:`ADDITIVE_METRICS`) add up, times ``additive_scale``
    (``1 / dp_size`` for ranks, whose terms are each their share × ``dp_size``); every other metric
    is weighted by its part's share of the step's trained tokens."""
    parts = list(parts)
    n_tokens = max(sum(tokens for _, tokens in parts), 1.0)
    out: dict[str, float] = {}
    for metrics, tokens in parts:
        for name, value in metrics.items():
            weight = additive_scale if name in ADDITIVE_METRICS else tokens / n_tokens
            out[name] = out.get(name, 0.0) + float(value) * weight
    return out


def mean_over_steps(steps: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """An update's metrics from its optimizer steps': each metric's mean over the steps, a count (a
    name whose last part starts with ``n_``) summed; and ``actor/n_updates``, the steps."""
    sums: dict[str, float] = {}
    for metrics in steps:
        for name, value in metrics.items():
            sums[name] = sums.get(name, 0.0) + float(value)
    out = {name: value if _is_count(name) else value / len(steps) for name, value in sums.items()}
    out["actor/n_updates"] = float(len(steps))
    return out


def _is_count(name: str) -> bool:
    return name.rpartition("/")[2].startswith("n_")


# -- the update --------------------------------------------------------------------------------------


@attrs.frozen
class ActorLoss:
    """verl's actor loss (:func:`ppo_loss`): the policy loss ``fn`` under ``settings``, the entropy bonus
    and the KL term's coefficients."""

    fn: PolicyLoss
    settings: LossSettings
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0

    def __call__(
        self, stats: ResponseStats, rows: UpdateBatch, settings: LossSettings
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return ppo_loss(
            self.fn,
            settings,
            stats,
            rows.tensors,
            rows.old_log_prob,
            rows.advantages,
            entropy_coeff=self.entropy_coeff,
            ref_log_prob=rows.ref_log_prob,
            kl_loss_coef=self.kl_loss_coef,
        )


@attrs.frozen
class DataParallel:
    """How one process's share of an optimizer step meets the other processes' (each trains its rows of
    every mini-batch with its share of the loss, ``dp_size`` = ``world``)."""

    world: int
    gather: Callable[[list[Any]], list[Any]]
    """Every process's list, concatenated in rank order (the step's metric parts)."""
    no_sync: Callable[[], AbstractContextManager[Any]] = nullcontext
    """Around every forward-backward of a step but its last: a wrapper that averages the gradients in
    the backward pass (``DistributedDataParallel.no_sync``) then averages them once per step, whatever
    number of micro-batches each process has."""
    reduce_gradients: Callable[[], None] | None = None
    """After a step's backward passes: average the gradients over the processes, where no wrapper does."""


@attrs.frozen
class ActorStep:
    """One optimizer step of the actor update, as verl's engine runs it: zero the gradients, then for
    each micro-batch the backend's ``forward`` (the policy's :class:`ResponseStats` of its rows), the
    ``loss`` (each micro-batch's its share of the mini-batch's) and ``backward``; with several
    processes their gradients averaged (:class:`DataParallel`); the gradients clipped at ``grad_clip``
    and ``optimizer`` stepped (:func:`optimizer_step`), inside ``optimizer_events`` (a backend's
    callbacks around the step). Called on a :class:`~agl_core.backends.micro_batching.MiniBatch`, it
    returns the step's metrics, from every process's parts (:func:`step_metrics`), and
    ``actor/n_micro_batches`` (this process's passes)."""

    forward: Callable[[UpdateBatch], ResponseStats]
    loss: ActorLoss
    optimizer: torch.optim.Optimizer
    parameters: Sequence[torch.nn.Parameter]
    grad_clip: float
    data_parallel: DataParallel | None = None
    backward: Callable[[torch.Tensor], Any] = torch.Tensor.backward
    optimizer_events: Callable[[], AbstractContextManager[Any]] = nullcontext

    def __call__(self, mini: MiniBatch) -> dict[str, float]:
        data_parallel, settings = self.data_parallel, self.loss.settings
        world = 1 if data_parallel is None else data_parallel.world
        if data_parallel is not None:
            settings = attrs.evolve(settings, dp_size=world)
        settings = attrs.evolve(settings, batch_num_tokens=mini.n_tokens)
        self.optimizer.zero_grad(set_to_none=True)
        parts = []
        for i, rows in enumerate(mini.parts):
            last = i == len(mini.parts) - 1
            with nullcontext() if data_parallel is None or last else data_parallel.no_sync():
                loss, metrics = self.loss(self.forward(rows), rows, settings)
                self.backward(loss)
            parts.append((metrics, float(rows.mask.sum())))
        if data_parallel is not None:
            if data_parallel.reduce_gradients is not None:
                data_parallel.reduce_gradients()
            parts = data_parallel.gather(parts)
        metrics = {**step_metrics(parts, 1 / world), "actor/n_micro_batches": float(len(mini.parts))}
        with self.optimizer_events():
            metrics.update(optimizer_step(self.optimizer, self.parameters, self.grad_clip))
        return metrics


def train_batch(
    step: ActorStep,
    mini_batches: Sequence[MiniBatch],
    *,
    epochs: int = 1,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> dict[str, float]:
    """The actor update of a training step (verl's ``BaseEngine.train_batch``): ``epochs`` passes of
    ``step`` over ``mini_batches`` (this process's), then ``scheduler``'s step, taken only when some
    optimizer step was (the schedule advances with the optimizer). Its metrics: each step's, averaged
    over the steps with counts summed (:func:`mean_over_steps`), ``actor/lr`` (the rate the steps
    used) and ``timing/actor_update_s``."""
    started = time.perf_counter()
    lr = float(step.optimizer.param_groups[0]["lr"])
    metrics = mean_over_steps([step(mini) for _ in range(epochs) for mini in mini_batches])
    if scheduler is not None and metrics["actor/n_updates"] > metrics.get("actor/n_skipped_nonfinite_grad", 0.0):
        scheduler.step()
    return {**metrics, "actor/lr": lr, "timing/actor_update_s": time.perf_counter() - started}
