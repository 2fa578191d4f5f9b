"""What every trace aggregator shares: its settings, its result, and the rules that finish a row.

An aggregator (see ``agl_register_aggregators``) turns completed rollouts into training rows. The
merge policy is the aggregator's own; what happens to a merged row afterwards is the same for all
of them and lives here, so a third-party aggregator keeps the same limits and counts:

- a row with no trained token is skipped (``training/n_skipped_empty_rows``);
- a row whose prompt exceeds ``max_prompt_length`` is kept whole and marked ``dropped``
  (``training/n_sample_dropped/marked``); batch shaping removes it before training;
- a response longer than ``max_response_length`` is cut, its mask, log-probs and turn indices with
  it (``training/n_truncated_sample``); a row left with no trained token is skipped instead;
- with ``max_total_length`` set, the response is also cut where prompt + response would pass it
  (Agent Lightning 1.0.2's ``trajectory_max_total_length``); each row it cuts is counted in
  ``training/n_truncated_sample/total_length`` too, and one whose prompt leaves no room is skipped;
- a row with images (``TrainingRow.image_urls``) keeps only the images whose placeholder blocks it
  holds whole: a response cut that would go through a block marks the row ``dropped`` instead, kept
  whole (``training/n_sample_dropped/marked`` and ``training/images/n_rows_dropped_at_cut``); the
  images of blocks past a cut are left out of the row;
- calls an aggregator leaves out on purpose (it trains only some calls of a rollout, e.g. the last)
  are counted, one per call, in ``training/n_calls_left_out`` (:meth:`AggregationCounts.leave_out`).

An aggregator whose rows of a rollout depend on that rollout alone can declare so by being a
:class:`PerRolloutAggregator`: the step pipeline then aggregates each rollout as the rollout source
finishes it, while the others still run, instead of the whole batch once the last one is done. The
batch's result is the same either way (:meth:`PerRolloutAggregator.combine`). Any other
aggregator gets the whole batch.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
from omegaconf import OmegaConf

from agl_core.config import row_length_keys
from agl_core.data import CompletedRollout, DataValidationError, TrainingRow, Triplet
from agl_core.errors import UsageError
from agl_core.fields import from_checked, is_int

__all__ = [
    "CALLS_LEFT_OUT_METRIC",
    "IMAGE_CUT_METRIC",
    "MISMATCH_KINDS",
    "TOTAL_LENGTH_CUT_METRIC",
    "Aggregation",
    "AggregationCounts",
    "AggregationSettings",
    "Aggregator",
    "ImagePlaceholders",
    "Mismatch",
    "PerRolloutAggregator",
    "RolloutAggregation",
    "Segment",
    "image_blocks",
    "merged_row",
    "rollout_reward",
    "settings_from_config",
    "write_mismatches_jsonl",
]

MISMATCH_KINDS = ("retokenization", "template", "other", "images")
CALLS_LEFT_OUT_METRIC = "training/n_calls_left_out"
TOTAL_LENGTH_CUT_METRIC = "training/n_truncated_sample/total_length"
# Not under training/n_sample_dropped/: those reasons add up to the rows dropped, and these rows are
# counted there as marked.
IMAGE_CUT_METRIC = "training/images/n_rows_dropped_at_cut"

IMAGE_PLACEHOLDER_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


@attrs.frozen
class ImagePlaceholders:
    """The token ids of an image's placeholder block (Qwen2-VL's layout): ``vision_start``, then one
    ``image_pad`` per image feature the model inserts there, then ``vision_end``."""

    vision_start: int
    image_pad: int
    vision_end: int

    @classmethod
    def of(cls, tokenizer: Any) -> ImagePlaceholders | None:
        """The ids of ``<|vision_start|>``, ``<|image_pad|>`` and ``<|vision_end|>`` in ``tokenizer``'s
        vocabulary; ``None`` when it has no such tokens (or no ``convert_tokens_to_ids``)."""
        convert = getattr(tokenizer, "convert_tokens_to_ids", None)
        if convert is None:
            return None
        ids = [convert(token) for token in IMAGE_PLACEHOLDER_TOKENS]
        unknown = getattr(tokenizer, "unk_token_id", None)
        if any(not is_int(i, minimum=0) or i == unknown for i in ids):
            return None
        return cls(*ids)


def image_blocks(ids: np.ndarray, image_pad: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` spans of the image placeholder blocks in ``ids``: each run of ``image_pad``
    ids with the token before it (``vision_start``) and the one after it (``vision_end``)."""
    is_pad = np.concatenate([[False], np.asarray(ids) == image_pad, [False]])
    edges = np.flatnonzero(is_pad[1:] != is_pad[:-1])
    return [(int(a) - 1, int(b) + 1) for a, b in zip(edges[::2], edges[1::2])]


def _positive_int(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_int(value, minimum=1):
        raise UsageError(f"AggregationSettings.{attribute.name} must be a positive int, got {value!r}")


def _non_negative_int(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_int(value, minimum=0):
        raise UsageError(f"AggregationSettings.{attribute.name} must be a non-negative int, got {value!r}")


def _decoder(_instance: Any, _attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not callable(getattr(value, "decode", None)):
        raise UsageError(f"AggregationSettings.tokenizer must have a decode(list[int]) -> str method, got {value!r}")


@attrs.frozen(kw_only=True)
class AggregationSettings:
    """The limits and diagnostics an aggregator works with.

    ``tokenizer`` is any object with ``decode(list[int]) -> str``; without one, breaks cannot be
    classified (they count as ``other``) and mismatch samples carry ids only. Each mismatch sample
    keeps at most ``mismatch_max_length`` ids and characters per field. ``max_total_length``
    (``None``: no cap) bounds a row's prompt + response (:meth:`response_limit`).
    ``image_placeholders`` (by default the tokenizer's, ``ImagePlaceholders.of``) tells where a
    row's image blocks are, which cutting the response of a row with images needs.
    """

    max_prompt_length: int = attrs.field(validator=_positive_int)
    max_response_length: int = attrs.field(validator=_positive_int)
    max_total_length: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive_int))
    tokenizer: Any = attrs.field(default=None, validator=_decoder, eq=False)
    mismatch_sample_size: int = attrs.field(default=20, validator=_non_negative_int)
    mismatch_max_length: int = attrs.field(default=2000, validator=_positive_int)
    image_placeholders: ImagePlaceholders | None = attrs.field(
        validator=attrs.validators.optional(attrs.validators.instance_of(ImagePlaceholders))
    )

    @image_placeholders.default
    def _tokenizer_placeholders(self) -> ImagePlaceholders | None:
        return ImagePlaceholders.of(self.tokenizer)

    def response_limit(self, prompt_length: int) -> int:
        """The most response tokens a row with a ``prompt_length``-token prompt keeps: ``max_response_length``,
        or less where prompt + response would pass ``max_total_length`` (0 when the prompt fills it)."""
        if self.max_total_length is None:
            return self.max_response_length
        return min(self.max_response_length, max(self.max_total_length - prompt_length, 0))


def settings_from_config(cfg: Any, tokenizer: Any = None) -> AggregationSettings:
    """Settings for the aggregator the config selects.

    The ``transition`` level uses verl's ``data.max_prompt_length`` / ``data.max_response_length``;
    every other level (``trajectory`` and third-party ones) uses
    ``agentlightning.trace_aggregator.trajectory_max_*``, as Agent Lightning does, the total too
    (Agent Lightning 1.0.2 reads ``trajectory_max_total_length`` at the trajectory level only).
    """
    agg = cfg.agentlightning.trace_aggregator
    prompt_key, response_key = row_length_keys(cfg)
    return AggregationSettings(
        max_prompt_length=OmegaConf.select(cfg, prompt_key),
        max_response_length=OmegaConf.select(cfg, response_key),
        max_total_length=None if agg.level == "transition" else agg.trajectory_max_total_length,
        tokenizer=tokenizer,
        mismatch_sample_size=agg.mismatch_sample_size,
        mismatch_max_length=agg.mismatch_max_length,
    )


@attrs.frozen(kw_only=True)
class Mismatch:
    """One trajectory break, kept for inspection.

    ``turn_index`` is the call whose prompt did not extend the context (the previous call's prompt +
    response), or, for kind ``images``, whose images did not start with the previous call's.
    ``common_prefix_length`` is how many leading ids they share; ``context_ids`` and ``prompt_ids``
    are the ids from there on, and ``context_text`` / ``prompt_text`` the decoded
    texts from a little before the first differing character (``text_offset``), each cut to the
    settings' ``mismatch_max_length``. Texts are ``None`` without a tokenizer.
    """

    rollout_id: str
    group_id: str
    turn_index: int
    kind: str = attrs.field(validator=attrs.validators.in_(MISMATCH_KINDS))
    context_length: int
    prompt_length: int
    common_prefix_length: int
    context_ids: tuple[int, ...]
    prompt_ids: tuple[int, ...]
    text_offset: int | None = None
    context_text: str | None = None
    prompt_text: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["context_ids"] = list(self.context_ids)
        out["prompt_ids"] = list(self.prompt_ids)
        return out


@attrs.frozen
class Aggregation:
    """An aggregator's result: the rows, its metrics (``training/*`` names) and a bounded mismatch sample."""

    rows: tuple[TrainingRow, ...] = attrs.field(converter=tuple)
    metrics: dict[str, float] = attrs.field(factory=dict)
    mismatches: tuple[Mismatch, ...] = attrs.field(default=(), converter=tuple)


class Aggregator(Protocol):
    """What ``agl_register_aggregators`` registers: the rows of completed rollouts, which it must not
    mutate; its rows are finished by :func:`merged_row`, so the limits and counts above hold."""

    __module__ = "agl_core"

    def __call__(self, rollouts: Sequence[CompletedRollout], settings: AggregationSettings) -> Aggregation: ...


@attrs.frozen
class RolloutAggregation:
    """One rollout's part of an aggregation: its rows, the counts made on it and its first
    trajectory breaks (at most the settings' ``mismatch_sample_size``)."""

    rows: tuple[TrainingRow, ...] = attrs.field(converter=tuple)
    counts: AggregationCounts
    mismatches: tuple[Mismatch, ...] = attrs.field(default=(), converter=tuple)


@attrs.frozen
class PerRolloutAggregator:
    """An aggregator declared to work on each rollout alone: ``aggregate_rollout(rollout, settings)
    -> RolloutAggregation`` gives one rollout's part, and the batch's aggregation is :meth:`combine`
    of its rollouts' parts (``trajectory``: report the merge counts every step, as
    :meth:`AggregationCounts.metrics`). Called on a batch, it is an ordinary :class:`Aggregator`;
    registered, it lets the step pipeline aggregate each rollout as soon as it is done
    (:meth:`StepPipeline.prepare_rollout <agl_core.stages.pipeline.StepPipeline.prepare_rollout>`)."""

    aggregate_rollout: Callable[[CompletedRollout, AggregationSettings], RolloutAggregation] = attrs.field(
        validator=attrs.validators.is_callable()
    )
    trajectory: bool = False
    name: str | None = attrs.field(default=None, kw_only=True)

    @property
    def __name__(self) -> str:
        """The name a function aggregator would have (code names plugins by ``fn.__name__``):
        ``name``, else ``aggregate_rollout``'s."""
        if self.name is not None:
            return self.name
        function = getattr(self.aggregate_rollout, "func", self.aggregate_rollout)  # a functools.partial's
        return getattr(function, "__name__", type(self).__name__)

    def __call__(self, rollouts: Sequence[CompletedRollout], settings: AggregationSettings) -> Aggregation:
        return self.combine((self.aggregate_rollout(r, settings) for r in rollouts), settings)

    def combine(self, parts: Iterable[RolloutAggregation], settings: AggregationSettings) -> Aggregation:
        """The batch's aggregation from its rollouts' parts, in batch order: rows and breaks in that
        order (the sample is the batch's first breaks), counts summed and the metrics computed from
        the sums, so means and rates come out as over the batch."""
        rows: list[TrainingRow] = []
        counts = AggregationCounts()
        mismatches: list[Mismatch] = []
        for part in parts:
            rows.extend(part.rows)
            counts.add(part.counts)
            mismatches.extend(part.mismatches[: settings.mismatch_sample_size - len(mismatches)])
        return Aggregation(rows, counts.metrics(trajectory=self.trajectory), mismatches)


def write_mismatches_jsonl(path: str | os.PathLike[str], mismatches: Iterable[Mismatch]) -> int:
    """Append one JSON line per mismatch to ``path`` (created with its folder); return how many."""
    n = 0
    folder = os.path.dirname(os.fspath(path))
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "a", encoding="utf-8") as out:
        for mismatch in mismatches:
            out.write(json.dumps(mismatch.to_dict(), ensure_ascii=False) + "\n")
            n += 1
    return n


def rollout_reward(rollout: CompletedRollout) -> float:
    """The final reward every row of ``rollout`` carries; refuse a rollout that has none."""
    if rollout.final_reward is None:
        raise DataValidationError(
            "final_reward",
            "is None: the events parser must fill a missing reward (reward_fillna_value) before aggregation",
            rollout.rollout_id,
        )
    return rollout.final_reward


def call_log_probs(triplet: Triplet) -> np.ndarray | None:
    """A call's log-probs when present and one per response token, else ``None``."""
    lp = triplet.response_log_probs
    if lp is None or len(lp) != len(triplet.response_ids):
        return None
    return lp


@attrs.frozen
class Segment:
    """One call merged into a row: the observation ids its prompt adds, then its response."""

    call_index: int
    triplet: Triplet
    observation: np.ndarray


_EMPTY_IDS = np.zeros(0, dtype=np.int64)


class AggregationCounts:
    """The counts behind the aggregation metrics, accumulated over a batch.

    A custom merge loop reports the same merge diagnostics as ``trajectory`` with
    :meth:`merge_break` (a call that could not be merged into the previous one's row, by kind) and
    :meth:`unmerged_rollout` (a rollout left in more than one row); :meth:`metrics` then reports
    every count made, whatever its ``trajectory`` flag.
    """

    __module__ = "agl_core"

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.response_lengths: list[int] = []

    def add(self, other: AggregationCounts) -> None:
        """Add ``other``'s counts to these (a batch's counts are the sum of its rollouts')."""
        self.counts.update(other.counts)
        self.response_lengths.extend(other.response_lengths)

    def add_rollout(self, rollout: CompletedRollout) -> None:
        if rollout.triplets:
            self.counts["training/n_rollouts_w_trace"] += 1
        self.counts["training/n_turns"] += len(rollout.triplets)
        self.response_lengths.extend(len(t.response_ids) for t in rollout.triplets)

    def leave_out(self, n_calls: int) -> None:
        """Count calls left out of every row on purpose (``training/n_calls_left_out``)."""
        self.counts[CALLS_LEFT_OUT_METRIC] += n_calls

    def merge_break(self, kind: str) -> None:
        """Count a break between two calls of a rollout (``training/n_trace_merge_mismatch_rows`` and
        ``training/trace_merge_mismatch/<kind>``); ``kind`` is one of :data:`MISMATCH_KINDS`
        (``images``: the call's images do not start with the row's, the history's images changed)."""
        if kind not in MISMATCH_KINDS:
            raise UsageError(f"merge break kind {kind!r} is not one of {', '.join(MISMATCH_KINDS)}")
        self.counts["training/n_trace_merge_mismatch_rows"] += 1
        self.counts[f"training/trace_merge_mismatch/{kind}"] += 1

    def unmerged_rollout(self) -> None:
        """Count a rollout whose calls ended up in more than one row (``training/n_unmerged_rollouts``)."""
        self.counts["training/n_unmerged_rollouts"] += 1

    def metrics(self, *, trajectory: bool = False) -> dict[str, float]:
        """The metrics: every count made, and with ``trajectory`` the merge counts as 0 too when none
        was made (a merging aggregator reports them every step)."""
        names = [
            "training/n_rollouts_w_trace",
            "training/n_turns",
            "training/n_sample_dropped/marked",
            "training/n_truncated_sample",
            "training/n_skipped_empty_rows",
        ]
        if trajectory:
            names += ["training/n_unmerged_rollouts", "training/n_trace_merge_mismatch_rows"]
            names += [f"training/trace_merge_mismatch/{kind}" for kind in MISMATCH_KINDS]
        out = {name: float(self.counts[name]) for name in names}
        for name, value in self.counts.items():
            out.setdefault(name, float(value))
        lengths = self.response_lengths or [0]
        out["response_length/training/avg_by_turn"] = float(np.mean(lengths))
        out["response_length/training/max_by_turn"] = float(np.max(lengths))
        out["response_length/training/min_by_turn"] = float(np.min(lengths))
        return out


def merged_row(
    rollout: CompletedRollout,
    segments: Sequence[Segment],
    settings: AggregationSettings,
    counts: AggregationCounts,
) -> TrainingRow | None:
    """Build the row of ``segments`` (consecutive calls of ``rollout``), apply the limits, count.

    The row's prompt is the first call's prompt; its response is, per call, the observation (mask
    0, log-prob 0) then the model's response (mask 1). Log-probs are kept only when every merged
    call has one per response token. The row's images are the first call's, then each later call's
    beyond those (each call's images must start with the row's). Returns ``None`` for a row with no
    trained token.
    """
    first = segments[0]
    images = _row_images(rollout, segments)
    have_log_probs = all(call_log_probs(seg.triplet) is not None for seg in segments)
    ids, lengths, masks, turns, lps = [], [], [], [], []
    for seg in segments:
        for part, mask in ((seg.observation, 0), (seg.triplet.response_ids, 1)):
            if not len(part):
                continue
            ids.append(part)
            lengths.append(len(part))
            masks.append(mask)
            turns.append(seg.call_index)
            if have_log_probs:
                lps.append(seg.triplet.response_log_probs if mask else np.zeros(len(part), dtype=np.float32))
    response = np.concatenate(ids) if ids else _EMPTY_IDS
    mask = np.repeat(np.array(masks, dtype=np.int8), lengths)
    response_turns = np.repeat(np.array(turns, dtype=np.int32), lengths)
    log_probs = (np.concatenate(lps) if lps else np.zeros(0, dtype=np.float32)) if have_log_probs else None

    if not mask.any():
        counts.counts["training/n_skipped_empty_rows"] += 1
        return None
    prompt = first.triplet.prompt_ids
    dropped = len(prompt) > settings.max_prompt_length
    cut = settings.response_limit(len(prompt))
    if dropped:
        counts.counts["training/n_sample_dropped/marked"] += 1
    elif len(response) > cut:
        if cut < settings.max_response_length:
            counts.counts[TOTAL_LENGTH_CUT_METRIC] += 1
        if not mask[:cut].any():
            counts.counts["training/n_skipped_empty_rows"] += 1
            return None
        kept = _images_before(rollout, response, cut, images, settings) if images else images
        if kept is None:  # the cut goes through an image's block: the row is left out whole
            dropped = True
            counts.counts["training/n_sample_dropped/marked"] += 1
            counts.counts[IMAGE_CUT_METRIC] += 1
        else:
            counts.counts["training/n_truncated_sample"] += 1
            response, mask, response_turns = response[:cut], mask[:cut], response_turns[:cut]
            log_probs = None if log_probs is None else log_probs[:cut]
            images = kept
    for array in (response, mask, response_turns, log_probs):
        if array is not None:
            array.flags.writeable = False
    # Every part comes from validated Triplets and has the row's dtypes and lengths: no second check.
    return from_checked(
        TrainingRow,
        prompt_ids=prompt,
        response_ids=response,
        response_mask=mask,
        log_probs=log_probs,
        reward=rollout_reward(rollout),
        rollout_id=rollout.rollout_id,
        group_id=rollout.group_id,
        turn_index=first.call_index,
        response_turns=response_turns,
        turn_rewards=tuple(seg.triplet.reward for seg in segments),
        dropped=dropped,
        image_urls=images,
    )


def _row_images(rollout: CompletedRollout, segments: Sequence[Segment]) -> tuple[str, ...]:
    """The images of a row of ``segments``: the first call's, then each later call's beyond them."""
    images = segments[0].triplet.image_urls
    for seg in segments[1:]:
        urls = seg.triplet.image_urls
        if urls[: len(images)] != images:
            raise DataValidationError(
                f"triplets[{seg.call_index}].image_urls",
                f"do not start with the {len(images)} image(s) of the calls merged before it into one row: "
                "a call whose history's images changed cannot continue the row (the trajectory aggregator "
                "breaks the row there, as kind 'images')",
                rollout.rollout_id,
            )
        images = urls
    return images


def _images_before(
    rollout: CompletedRollout, response: np.ndarray, cut: int, images: tuple[str, ...], settings: AggregationSettings
) -> tuple[str, ...] | None:
    """The images a row keeps when its response is cut at ``cut``: those whose blocks end before it;
    ``None`` when the cut goes through a block."""
    placeholders = settings.image_placeholders
    if placeholders is None:
        raise UsageError(
            f"rollout {rollout.rollout_id!r}: a row with images is cut, and the aggregation settings do not know "
            "the image placeholder tokens; give AggregationSettings a tokenizer that has "
            f"{', '.join(IMAGE_PLACEHOLDER_TOKENS)} (or image_placeholders)"
        )
    cut_off = 0
    for start, end in image_blocks(response, placeholders.image_pad):
        if start < cut < end:
            return None
        cut_off += start >= cut
    return images[: max(0, len(images) - cut_off)]
