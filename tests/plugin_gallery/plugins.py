"""Five plugins as a plugin author writes them (public API only), each with realistic planted bugs.

Every plugin kind has a correct implementation, a slow obviously-correct reference written another
way, and a table ``BUGS`` of variants, each differing from the correct one by one mistake.
"""

from __future__ import annotations

import csv

import attrs
import numpy as np
import torch

from agl_core import (
    Advantages,
    Aggregation,
    AggregationCounts,
    Segment,
    broadcast,
    group_rollouts,
    merged_row,
    require_group_size,
    rollout_reward,
)

# -- a windowed aggregator: the last K calls of each rollout, one row each -------------------------

WINDOW = 2
NO_OBSERVATION = np.zeros(0, dtype=np.int64)


def windowed(k: int = WINDOW, window=lambda n, k: range(max(0, n - k), n), leave_out=lambda n, kept: n - len(kept)):
    def aggregate(rollouts, settings):
        counts = AggregationCounts()
        rows = []
        for rollout in rollouts:
            rollout_reward(rollout)
            counts.add_rollout(rollout)
            n = len(rollout.triplets)
            kept = window(n, k)
            counts.leave_out(leave_out(n, kept))
            for index in kept:
                row = merged_row(rollout, [Segment(index, rollout.triplets[index], NO_OBSERVATION)], settings, counts)
                if row is not None:
                    rows.append(row)
        return Aggregation(rows, counts.metrics(trajectory=False), [])

    return aggregate


def windowed_reference(rollouts, settings):
    """Slice the last K calls; each is a row of its own."""
    counts = AggregationCounts()
    rows = []
    for rollout in rollouts:
        rollout_reward(rollout)
        counts.add_rollout(rollout)
        kept = list(enumerate(rollout.triplets))[-WINDOW:] if rollout.triplets else []
        counts.leave_out(len(rollout.triplets) - len(kept))
        for index, call in kept:
            row = merged_row(rollout, [Segment(index, call, NO_OBSERVATION)], settings, counts)
            if row is not None:
                rows.append(row)
    return Aggregation(rows, counts.metrics(trajectory=False), [])


def windowed_trained_calls(rollout, settings):
    return range(max(0, len(rollout.triplets) - WINDOW), len(rollout.triplets))


def _sorts_input(rollouts, settings):
    rollouts.sort(key=lambda r: r.rollout_id)
    return windowed()(rollouts, settings)


def _last_call_reward(rollouts, settings):
    result = windowed()(rollouts, settings)
    calls = {r.rollout_id: r.triplets for r in rollouts}
    rows = [attrs.evolve(row, reward=calls[row.rollout_id][row.turn_index].reward or row.reward) for row in result.rows]
    return attrs.evolve(result, rows=rows)


def _no_truncation(rollouts, settings):
    return windowed()(rollouts, attrs.evolve(settings, max_response_length=10**6))


AGGREGATOR_BUGS = {
    "window off by one (K+1 calls)": windowed(window=lambda n, k: range(max(0, n - k - 1), n)),
    "window from the start (first K calls)": windowed(window=lambda n, k: range(min(k, n))),
    "left-out calls not counted": windowed(leave_out=lambda n, kept: 0),
    "left-out count is K, not n - K": windowed(leave_out=lambda n, kept: min(n, WINDOW)),
    "sorts the rollouts in place": _sorts_input,
    "row reward is the last call's reward": _last_call_reward,
    "ignores max_response_length": _no_truncation,
}


# -- a leave-one-out estimator with a length penalty ----------------------------------------------

PENALTY = 0.01


def loo_length(
    penalty: float = PENALTY,
    tokens=lambda row: int(row.response_mask.sum()),
    include_self=False,
    per_group=True,
    divide_by=lambda n: n - 1,
):
    def estimate(rows, settings):
        indexed = group_rollouts(rows)
        require_group_size(indexed, "loo_length", 2)
        length: dict[str, int] = {}
        for row in rows:
            length[row.rollout_id] = length.get(row.rollout_id, 0) + tokens(row)
        shaped = {rid: indexed.reward[rid] - penalty * length[rid] for rid in indexed.reward}
        everyone = list(shaped)
        value = {}
        for rids in indexed.groups.values():
            pool = rids if per_group else everyone
            total = sum(shaped[r] for r in pool)
            for rid in rids:
                if include_self:
                    value[rid] = shaped[rid] - total / len(pool)
                else:
                    value[rid] = shaped[rid] - (total - shaped[rid]) / divide_by(len(pool))
        return Advantages(
            per_row=tuple(broadcast(row, value[row.rollout_id]) for row in rows), metrics=indexed.metrics()
        )

    return estimate


def loo_length_reference(rows, settings):
    """For each rollout: its reward minus PENALTY per trained token, minus the others' mean."""
    rollouts = {}
    for row in rows:
        entry = rollouts.setdefault(row.rollout_id, {"group": row.group_id, "reward": row.reward, "tokens": 0})
        entry["tokens"] += int(np.sum(row.response_mask == 1))
    shaped = {rid: e["reward"] - PENALTY * e["tokens"] for rid, e in rollouts.items()}
    value = {}
    for rid, e in rollouts.items():
        others = [shaped[o] for o, f in rollouts.items() if f["group"] == e["group"] and o != rid]
        value[rid] = shaped[rid] - sum(others) / len(others)
    return Advantages(per_row=tuple(broadcast(row, value[row.rollout_id]) for row in rows))


def _sorts_rows(rows, settings):
    rows.sort(key=lambda row: row.rollout_id)
    return loo_length()(rows, settings)


def _first_row_only(rows, settings):
    seen = set()

    def first_row_tokens(row):
        if row.rollout_id in seen:
            return 0
        seen.add(row.rollout_id)
        return int(row.response_mask.sum())

    return loo_length(tokens=first_row_tokens)(rows, settings)


ESTIMATOR_BUGS = {
    "baseline includes the rollout itself": loo_length(include_self=True),
    "penalty with the wrong sign (rewards length)": loo_length(penalty=-PENALTY),
    "penalty counts observation tokens too": loo_length(tokens=lambda row: len(row.response_ids)),
    "penalty counts only a rollout's first row": _first_row_only,
    "baseline divides by n, not n - 1": loo_length(divide_by=lambda n: n),
    "baseline over the whole batch, not the group": loo_length(per_group=False),
    "sorts the rows in place": _sorts_rows,
}


# -- a GSPO-style sequence-ratio loss ------------------------------------------------------------


def gspo(clamp=20.0, use_dp=True, mean_ratio=True, swap_bounds=False, pessimistic=True, select=True):
    def loss(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None):
        mask = response_mask.bool()
        zero = torch.zeros_like(log_prob)
        if select:
            diff = torch.where(mask, log_prob - old_log_prob, zero)
            adv_tokens = torch.where(mask, advantages, zero)
        else:
            diff = (log_prob - old_log_prob) * mask
            adv_tokens = advantages * mask
        n_row = mask.sum(dim=1).clamp(min=1)
        log_ratio = diff.sum(dim=1) / (n_row if mean_ratio else 1)
        if clamp is not None:
            log_ratio = log_ratio.clamp(-clamp, clamp)
        ratio = torch.exp(log_ratio)
        adv = adv_tokens.sum(dim=1) / n_row
        low, high = (settings.high, settings.low) if swap_bounds else (settings.low, settings.high)
        unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - low, 1 + high)
        per_row = torch.maximum(unclipped, clipped) if pessimistic else torch.minimum(unclipped, clipped)
        n_tokens = mask.sum() if settings.batch_num_tokens is None else settings.batch_num_tokens
        value = (per_row * n_row).sum() / n_tokens * (settings.dp_size if use_dp else 1)
        clipfrac = float(((ratio < 1 - low) | (ratio > 1 + high)).double().mean())
        return value, {
            "actor/pg_clipfrac": clipfrac,
            "actor/ppo_kl": float(-log_ratio.detach().mean()),
            "actor/pg_clipfrac_lower": 0.0,
        }

    return loss


def gspo_reference(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None):
    """Row by row: the sequence ratio, the PPO-clipped sequence objective, weighted by the row's tokens."""
    total = torch.zeros((), dtype=log_prob.dtype)
    for i in range(log_prob.shape[0]):
        trained = response_mask[i].bool()
        n = int(trained.sum())
        ratio = torch.exp((log_prob[i][trained] - old_log_prob[i][trained]).mean().clamp(-20, 20))
        a = advantages[i][trained].mean()
        objective = torch.minimum(ratio * a, ratio.clamp(1 - settings.low, 1 + settings.high) * a)
        total = total - objective * n
    n_tokens = int(response_mask.sum()) if settings.batch_num_tokens is None else settings.batch_num_tokens
    return total / n_tokens * settings.dp_size, {
        "actor/pg_clipfrac": 0.0,
        "actor/ppo_kl": 0.0,
        "actor/pg_clipfrac_lower": 0.0,
    }


def _row_normalised(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None):
    value, metrics = gspo()(
        old_log_prob, log_prob, advantages, response_mask, attrs.evolve(settings, batch_num_tokens=None)
    )
    return value, metrics


def _casts_to_half(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None):
    return gspo()(old_log_prob.half(), log_prob.half(), advantages.half(), response_mask, settings)


LOSS_BUGS = {
    "forgets dp_size": gspo(use_dp=False),
    "no clamp before exp": gspo(clamp=None),
    "low and high clip bounds swapped": gspo(swap_bounds=True),
    "optimistic bound (min for max)": gspo(pessimistic=False),
    "sequence ratio sums, not averages, log-ratios": gspo(mean_ratio=False),
    "multiplies by the mask (NaN padding leaks)": gspo(select=False),
    "normalises by the micro-batch's own tokens": _row_normalised,
    "computes in float16": _casts_to_half,
}


# -- a CSV metric sink ---------------------------------------------------------------------------

CSV_FILE = "metrics.csv"


class CsvSink:
    """One row per step in ``metrics.csv`` (columns: step, then every metric name seen); written
    when the run closes. A resumed run keeps the earlier run's steps before its first one."""

    fixed_header = False
    drop_redone = True
    keep_earlier = True
    write_on_close = True
    sort_as_text = False
    samples_as_step = False

    def __init__(self, context):
        self.path = context.run_dir / CSV_FILE
        self.rows: list[dict[str, str]] = []
        self.earlier: list[dict[str, str]] = []
        if self.keep_earlier and self.path.is_file():
            with self.path.open(newline="") as f:
                self.earlier = list(csv.DictReader(f))
        self.first_step = None

    def log_samples(self, step, samples):
        if self.samples_as_step:
            self.rows.append({"step": str(step)})

    def log_metrics(self, step, metrics):
        if self.first_step is None:
            self.first_step = step
        self.rows.append({"step": str(step), **{name: repr(float(value)) for name, value in metrics.items()}})

    def close(self):
        if not self.write_on_close:
            return
        earlier = [row for row in self.earlier if not self.drop_redone or int(row["step"]) < (self.first_step or 0)]
        rows = earlier + self.rows
        if self.sort_as_text:
            rows.sort(key=lambda row: row["step"])
        names = list(dict.fromkeys(name for row in (rows[:1] if self.fixed_header else rows) for name in row))
        with self.path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=names, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)


def read_csv_sink(context):
    """What the CSV sink recorded: (step, metrics) per line, an empty cell being no metric."""
    path = context.run_dir / CSV_FILE
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return [
            (int(row.pop("step")), {k: float(v) for k, v in row.items() if v not in ("", None)})
            for row in csv.DictReader(f)
        ]


def _sink(**flags):
    return type("BuggyCsvSink", (CsvSink,), flags)


SINK_BUGS = {
    "header fixed at the first step": _sink(fixed_header=True),
    "a resumed run appends the redone steps again": _sink(drop_redone=False),
    "a resumed run overwrites the earlier steps": _sink(keep_earlier=False),
    "never writes (no flush on close)": _sink(write_on_close=False),
    "steps sorted as text (10 before 2)": _sink(sort_as_text=True),
    "a sample table logged as a step of its own": _sink(samples_as_step=True),
}


# -- a tagging lifecycle hook --------------------------------------------------------------------

TAG = "gallery"
CALLS_EVENT = "tagging.calls"


class Tagging:
    """Tags every request with its split and step; records each rollout's number of calls."""

    def tags(self, request):
        return {"tag": TAG, "split": "train" if request.is_train else "val", "step": request.step}

    def agl_on_enqueue(self, request):
        return attrs.evolve(request, metadata={**request.metadata, **self.tags(request)})

    def agl_on_succeeded(self, rollout, events, writer):
        writer.add_event(rollout.rollout_id, rollout.attempt_id or "0", CALLS_EVENT, {"calls": len(rollout.triplets)})

    def agl_on_failed(self, rollout, writer):
        reason = (rollout.error or "unknown").split(":")[0]
        writer.add_event(rollout.rollout_id, rollout.attempt_id or "0", "tagging.failed", {"reason": reason})


def expected_tagged(request):
    metadata = dict(request.metadata)
    metadata.update(tag=TAG, split="train" if request.is_train else "val", step=request.step)
    return attrs.evolve(request, metadata=metadata)


class _RenamesRollout(Tagging):
    def agl_on_enqueue(self, request):
        return attrs.evolve(super().agl_on_enqueue(request), rollout_id=request.rollout_id + "-tagged")


class _ReturnsMetadata(Tagging):
    def agl_on_enqueue(self, request):
        return {**request.metadata, **self.tags(request)}


class _SetInMetadata(Tagging):
    def tags(self, request):
        return {**super().tags(request), "tags": {TAG, "v2"}}


class _AppendsToEvents(Tagging):
    def agl_on_succeeded(self, rollout, events, writer):
        events.setdefault(rollout.attempt_id or "0", []).append(
            {"event_type": CALLS_EVENT, "data": {"calls": len(rollout.triplets)}}
        )


class _LastCallCrashes(Tagging):
    def agl_on_succeeded(self, rollout, events, writer):
        last = rollout.triplets[-1]
        writer.add_event(
            rollout.rollout_id,
            rollout.attempt_id or "0",
            CALLS_EVENT,
            {"calls": len(rollout.triplets), "last": len(last.response_ids)},
        )


class _ErrorNoneCrashes(Tagging):
    def agl_on_failed(self, rollout, writer):
        writer.add_event(
            rollout.rollout_id, rollout.attempt_id or "0", "tagging.failed", {"reason": rollout.error.split(":")[0]}
        )


class _SplitInverted(Tagging):
    def tags(self, request):
        return {**super().tags(request), "split": "val" if request.is_train else "train"}


class _DropsMetadata(Tagging):
    def agl_on_enqueue(self, request):
        return attrs.evolve(request, metadata=self.tags(request))


class _WritesForTheGroup(Tagging):
    def agl_on_succeeded(self, rollout, events, writer):
        writer.add_event(rollout.group_id, rollout.attempt_id or "0", CALLS_EVENT, {"calls": len(rollout.triplets)})


HOOK_BUGS = {
    "changes the rollout id": _RenamesRollout(),
    "returns the metadata dict, not a request": _ReturnsMetadata(),
    "puts a set in the metadata (not JSON)": _SetInMetadata(),
    "appends its event to the events it was given": _AppendsToEvents(),
    "crashes on a rollout without calls": _LastCallCrashes(),
    "crashes on a failure without an error message": _ErrorNoneCrashes(),
    "tags train requests as validation": _SplitInverted(),
    "replaces the batch metadata instead of adding to it": _DropsMetadata(),
    "writes its event under the group id": _WritesForTheGroup(),
}
