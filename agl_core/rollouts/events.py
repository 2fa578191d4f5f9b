"""Turn a rollout's recorded events into a :class:`~agl_core.data.CompletedRollout`.

The input is what the Agent Lightning gateway returns from ``GET /api/rollouts/{id}/events`` (the
raw format): a list of dicts with ``event_type``, ``data``, ``attempt_id`` and ``timestamp``. Every
rollout source records events in this shape, so this module is the one place where events become
Triplets and a reward.

Rules (Agent Lightning v1.0 semantics, with every anomaly counted instead of dropped silently):

- A ``model_request`` becomes a Triplet only when the call succeeded: ``status`` is not ``"error"``,
  ``http_status`` is below 400, the upstream response carries no ``error``, and it holds a non-empty
  list of response token ids. Prompt ids are ``response.prompt_token_ids`` (chat) or
  ``response.choices[0].prompt_token_ids`` (completions); response ids are
  ``choices[0].token_ids``; log-probs are ``choices[0].logprobs.content[*].logprob`` (chat) or
  ``choices[0].logprobs.token_logprobs`` (completions).
- A call whose token ids are missing or garbled (not a list of non-negative ints) is not trained on
  and is counted. Log-probs that are missing leave the Triplet without log-probs; log-probs that are
  unusable (non-numeric, non-finite, positive, or not one per response token) do the same and are
  counted.
- Unlike the gateway's ``format=triplet`` view, two calls with an identical prompt both become
  Triplets: each is a real sample the policy generated.
- ``reward`` events carry ``data.value``. The **last valid** reward event without a ``call_index``
  is the rollout's final reward. A reward event with ``data.call_index = k`` is the reward of the
  rollout's k-th ``model_request`` (0-based, counting every model_request event in order, failed
  calls included, which is how an agent counts its own calls); it lands on that call's
  ``Triplet.reward`` (last one wins). Booleans, non-numbers and non-finite values are refused and
  counted, never coerced.
- A rollout without a final reward gets ``reward_fillna_value`` and is counted.
- A training call's images are the ``image_url`` parts of its request's chat messages, in order of
  appearance across messages and parts (``{"type": "image_url", "image_url": {"url": ...}}`` or
  ``"image_url": "..."``; a message's content may be its parts' JSON text): their URLs become
  ``Triplet.image_urls`` (the prompt ids hold their placeholder blocks, as the server expanded them).
  A call with an ``image_url`` part that holds no URL string is not trained on and is counted; an
  image the trainer cannot load offline (an ``http(s)`` URL: the trainer fetches nothing from the
  network) is a :class:`DataValidationError` naming the rollout and ``calls[i].image_urls[j]``.
  Messages are decoded only when they mention ``image_url`` at all. A validation rollout's calls
  are measured, never trained: their images are not read.

Counts come back as a :class:`collections.Counter` keyed by metric name, so a source can add the
counters of a batch and report them.

:func:`decode_events` turns an events body (the HTTP response's bytes) into that list. Most of a raw
body is what the parser never reads (the request's messages, per-token records with their text,
bytes and alternatives, usage); decoded in full, each of those becomes Python objects, and the
containers among them keep the garbage collector busy, which costs several times more than the
parse itself. ``only_parsed_fields=True`` decodes, with msgspec, only the fields read here (typed
dicts that skip every other field without building it); a body that does not fit that shape is
decoded in full, so the parser meets and counts whatever is odd in it exactly as before. Without
msgspec, the standard library's ``json`` decodes everything.
"""

from __future__ import annotations

import json
import operator
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict

import attrs
import numpy as np

from agl_core.data import CompletedRollout, DataValidationError, RolloutRequest, Triplet
from agl_core.fields import (
    FrozenDict,
    freeze,
    from_checked,
    image_urls,
    json_token_ids,
    log_probs,
    reward_value,
    timestamp,
)

try:
    import msgspec
except ImportError:  # the standard library's json decodes everything
    msgspec = None

__all__ = [
    "METRICS",
    "FailedRolloutPolicy",
    "ParsedEvents",
    "apply_failed_policy",
    "completed_rollout",
    "completed_rollout_from_record",
    "decode_events",
    "events_by_attempt",
    "last_event_time",
    "parse_events",
    "rollout_timing_metrics",
    "source_metrics",
]

# Metric name -> what it counts. Every anomaly the parser meets increments one of these.
METRICS = {
    "training/n_rollouts_w_reward": "rollouts whose agent reported a valid final reward",
    "training/n_rollouts_reward_filled": "rollouts without a valid final reward, given reward_fillna_value",
    "training/events/n_calls": "model_request events read",
    "training/events/n_failed_calls": "model calls that failed (status error, HTTP >= 400, upstream error)",
    "training/events/n_calls_missing_token_ids": "successful calls without prompt or response token ids",
    "training/events/n_calls_garbled_token_ids": "calls whose token ids are not lists of non-negative ints",
    "training/events/n_calls_empty_response": "successful calls that generated no token",
    "training/events/n_calls_bad_images": "calls with an image_url part that holds no URL string (not trained)",
    "training/events/n_calls_wo_log_probs": "Triplets without log-probs because the response had none",
    "training/events/n_calls_bad_log_probs": "Triplets without log-probs because they were unusable",
    "training/events/n_reward_events": "reward events read",
    "training/events/n_bad_rewards": "reward events refused (boolean, non-numeric, non-finite, missing)",
    "training/events/n_bad_reward_call_index": "reward events refused for an invalid call_index",
    "training/events/n_orphan_call_rewards": "per-call rewards whose call produced no Triplet",
    "training/events/n_malformed_events": "events that are not dicts with a string event_type and dict data",
    "training/events/n_other_events": "events of other types (kept for hooks, not used for training)",
    "training/events/n_bad_timestamps": "event or rollout-record times ignored (boolean, non-numeric, non-finite)",
}


@attrs.frozen
class ParsedEvents:
    """Triplets, final reward and anomaly counts read from one rollout's events."""

    triplets: tuple[Triplet, ...]
    final_reward: float | None
    counts: Counter[str]


# -- decoding ---------------------------------------------------------------------------------------
# The fields of an event that this module reads (every one optional, of any JSON type where the
# parser checks the type itself). Keep in step with _triplet_from_call, parse_events, last_attempt_id
# and completed_rollout: a field read there but missing here would be read as absent (a property test
# checks that both decodes give the same rollouts, whatever the bodies hold).


class _TokenLogProb(TypedDict, total=False):
    logprob: Any


class _LogProbs(TypedDict, total=False):
    content: list[_TokenLogProb]
    token_logprobs: Any


class _Choice(TypedDict, total=False):
    token_ids: Any
    prompt_token_ids: Any
    logprobs: _LogProbs | None


class _Response(TypedDict, total=False):
    prompt_token_ids: Any
    choices: list[_Choice]
    error: Any


class _Request(TypedDict, total=False):
    messages: msgspec.Raw  # kept undecoded: decoded only when it mentions images (_image_urls)


class _Data(TypedDict, total=False):
    request: _Request | None
    http_status: Any
    status: Any
    response: _Response | None
    server: Any
    model_version: Any
    finish_reason: Any
    value: Any
    call_index: Any


class _Event(TypedDict, total=False):
    event_type: Any
    attempt_id: Any
    timestamp: Any
    data: _Data


if msgspec is not None:
    _decode_any = msgspec.json.Decoder().decode
    _decode_parsed_fields = msgspec.json.Decoder(list[_Event]).decode


def decode_events(body: bytes, *, only_parsed_fields: bool = False) -> Any:
    """An events body (JSON bytes) decoded, in full or, with ``only_parsed_fields``, only the fields
    this module reads (see the module's docstring); what JSON does not allow is a ``ValueError``.

    msgspec refuses a few things the standard library accepts (``NaN``, numbers beyond float range,
    lone surrogates): such a body is decoded by the standard library, as it always was.
    """
    if msgspec is None:
        return json.loads(body)
    if only_parsed_fields:
        try:
            return _decode_parsed_fields(body)
        except msgspec.DecodeError:  # not of that shape, or not for msgspec: decoded in full
            pass
    try:
        return _decode_any(body)
    except msgspec.DecodeError:
        return json.loads(body)


# -- parsing ----------------------------------------------------------------------------------------


def _count(counts: Counter[str], name: str) -> None:
    assert name in METRICS, name
    counts[name] += 1


def _call_failed(data: Mapping[str, Any]) -> bool:
    http_status = data.get("http_status")
    if isinstance(http_status, int) and not isinstance(http_status, bool) and http_status >= 400:
        return True
    response = data.get("response")
    return data.get("status") == "error" or (isinstance(response, Mapping) and "error" in response)


_LOGPROB = operator.itemgetter("logprob")


def _raw_log_probs(choice: Mapping[str, Any]) -> Any:
    """The per-token log-prob list in either OpenAI schema; ``None`` when the response has none."""
    logprobs = choice.get("logprobs")
    if logprobs is None:
        return None
    if not isinstance(logprobs, Mapping):
        return logprobs  # present but unusable: let validation refuse it
    content = logprobs.get("content")
    if isinstance(content, list):
        try:
            return list(map(_LOGPROB, content))  # every item a dict with a logprob: no per-item Python call
        except (KeyError, TypeError, IndexError):
            return [item.get("logprob") if isinstance(item, Mapping) else item for item in content]
    return logprobs.get("token_logprobs", logprobs)


def _model_version(value: Any) -> int | None:
    """The weights version that served a call: a non-negative int below 2**63, else unknown (``None``,
    which the staleness metrics count as a call without a version)."""
    if type(value) is int and 0 <= value < 2**63:
        return value
    return None


_IMAGE_URL = re.compile(rb"image_url")


def _part_url(part: Mapping[str, Any]) -> str | None:
    """The URL of one ``image_url`` part (``{"url": ...}`` or the URL itself); ``None`` without one."""
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, Mapping) else image
    return url if isinstance(url, str) else None


def _content_images(content: Any) -> list[str | None]:
    """The image URLs of one message's content (a list of parts, or its JSON text), in order (``None``
    for a part without one)."""
    if isinstance(content, str) and "image_url" in content:
        try:
            content = json.loads(content)  # some clients send the parts as JSON text
        except ValueError:
            return []
    if not isinstance(content, list):
        return []
    return [_part_url(part) for part in content if isinstance(part, Mapping) and part.get("type") == "image_url"]


def _image_urls(request: Any) -> list[str | None]:
    """The image URLs a call's request carries in its chat messages, in order (undecoded messages are
    only decoded when they mention ``image_url`` at all); ``None`` for a part without one."""
    messages = request.get("messages") if isinstance(request, Mapping) else None
    if msgspec is not None and isinstance(messages, msgspec.Raw):
        if _IMAGE_URL.search(messages) is None:  # searched in place: the messages are not copied
            return []
        messages = _decode_any(messages)
    if not isinstance(messages, list):
        return []
    return [url for m in messages if isinstance(m, Mapping) for url in _content_images(m.get("content"))]


def _triplet_from_call(data: Any, call_index: int, counts: Counter[str], *, read_images: bool) -> Triplet | None:
    """One successful model call as a Triplet, or ``None`` (counted) when it cannot be trained on;
    with ``read_images``, with its request's image URLs (one the trainer cannot load is a
    :class:`DataValidationError`)."""
    if not isinstance(data, Mapping):
        _count(counts, "training/events/n_malformed_events")
        return None
    if _call_failed(data):
        _count(counts, "training/events/n_failed_calls")
        return None
    response = data.get("response")
    choices = response.get("choices") if isinstance(response, Mapping) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        _count(counts, "training/events/n_calls_missing_token_ids")
        return None
    choice = choices[0]
    prompt = response.get("prompt_token_ids") or choice.get("prompt_token_ids")
    generated = choice.get("token_ids")
    if prompt is None or generated is None or (isinstance(prompt, list) and not prompt):
        _count(counts, "training/events/n_calls_missing_token_ids")
        return None
    try:
        prompt_ids = json_token_ids("prompt_ids", prompt)
        response_ids = json_token_ids("response_ids", generated)
    except DataValidationError:
        _count(counts, "training/events/n_calls_garbled_token_ids")
        return None
    if not len(response_ids):
        _count(counts, "training/events/n_calls_empty_response")
        return None
    urls: tuple[str, ...] = ()
    if read_images:
        found = _image_urls(data.get("request"))
        if None in found:  # an image_url part without a URL
            _count(counts, "training/events/n_calls_bad_images")
            return None
        try:
            urls = image_urls("image_urls", found)
        except DataValidationError as err:
            raise err.within(f"calls[{call_index}]") from None
    raw = _raw_log_probs(choice)
    response_log_probs = None
    if raw is None:
        _count(counts, "training/events/n_calls_wo_log_probs")
    else:
        try:
            response_log_probs = log_probs("response_log_probs", raw, len(response_ids))
        except (DataValidationError, TypeError, ValueError):
            _count(counts, "training/events/n_calls_bad_log_probs")
    server = data.get("server") if isinstance(data.get("server"), Mapping) else {}
    metadata = {
        "call_index": call_index,
        "model_version": _model_version(server.get("version", data.get("model_version"))),
    }
    if data.get("finish_reason") is not None:
        metadata["finish_reason"] = freeze(data["finish_reason"])
    return from_checked(
        Triplet,
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        response_log_probs=response_log_probs,
        reward=None,
        metadata=FrozenDict(metadata),
        image_urls=urls,
    )


def _reward(data: Mapping[str, Any], counts: Counter[str]) -> float | None:
    try:
        return reward_value("reward", data.get("value"))
    except DataValidationError:
        _count(counts, "training/events/n_bad_rewards")
        return None


def parse_events(events: Sequence[Any], *, read_images: bool = True) -> ParsedEvents:
    """Triplets (successful calls, in order), the final reward (``None`` if none) and the counts.
    ``read_images``: read each call's image URLs onto its Triplet (training rollouts; see the
    module's docstring)."""
    counts: Counter[str] = Counter()
    calls: list[Triplet | None] = []
    call_rewards: dict[int, float] = {}
    final_reward: float | None = None
    for event in events:
        if not isinstance(event, Mapping) or not isinstance(event.get("event_type"), str):
            _count(counts, "training/events/n_malformed_events")
            continue
        kind, data = event["event_type"], event.get("data")
        if kind == "model_request":
            _count(counts, "training/events/n_calls")
            calls.append(_triplet_from_call(data, len(calls), counts, read_images=read_images))
        elif kind == "reward":
            _count(counts, "training/events/n_reward_events")
            if not isinstance(data, Mapping):
                _count(counts, "training/events/n_bad_rewards")
                continue
            value = _reward(data, counts)
            if value is None:
                continue
            if "call_index" not in data:
                final_reward = value
                continue
            index = data["call_index"]
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                _count(counts, "training/events/n_bad_reward_call_index")
                continue
            call_rewards[index] = value
        else:
            _count(counts, "training/events/n_other_events")
    triplets = []
    for index, triplet in enumerate(calls):
        if triplet is None:
            continue
        if index in call_rewards:
            triplet = from_checked(
                Triplet,
                prompt_ids=triplet.prompt_ids,
                response_ids=triplet.response_ids,
                response_log_probs=triplet.response_log_probs,
                reward=call_rewards.pop(index),
                metadata=triplet.metadata,
                image_urls=triplet.image_urls,
            )
        triplets.append(triplet)
    for index in call_rewards:
        name = "n_bad_reward_call_index" if index >= len(calls) else "n_orphan_call_rewards"
        _count(counts, f"training/events/{name}")
    return ParsedEvents(tuple(triplets), final_reward, counts)


def events_by_attempt(events: Sequence[Any], default_attempt_id: str = "0") -> dict[str, list[dict[str, Any]]]:
    """Events grouped by ``attempt_id`` in order (what ``agl_on_succeeded`` receives)."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for event in events:
        attempt = event.get("attempt_id") if isinstance(event, Mapping) else None
        grouped.setdefault(str(attempt or default_attempt_id), []).append(event)
    return grouped or {default_attempt_id: []}


def _time(value: Any, counts: Counter[str]) -> float | None:
    """A timestamp as a float; ``None`` when absent, or when unusable (counted)."""
    if value is None:
        return None
    try:
        return timestamp("timestamp", value)
    except DataValidationError:
        _count(counts, "training/events/n_bad_timestamps")
        return None


def completed_rollout(
    request: RolloutRequest,
    events: Sequence[Any],
    *,
    state: str,
    reward_fillna_value: float,
    error: str | None = None,
    attempt_id: str | None = None,
    queued_at: float | None = None,
    ended_at: float | None = None,
) -> tuple[CompletedRollout, Counter[str]]:
    """The completed rollout for ``request`` from its raw ``events``, and the anomaly counts.

    ``started_at`` is the timestamp of the first event (the agent's first call), the earliest moment
    the trainer can see the agent running. Timestamps that are not finite numbers, there or in
    ``queued_at`` / ``ended_at``, are left out and counted.
    """
    try:  # a validation rollout's calls are measured, never trained: their images are not read
        parsed = parse_events(events, read_images=request.is_train)
    except DataValidationError as exc:
        raise exc.within(rollout_id=request.rollout_id) from None
    counts = parsed.counts
    final_reward = parsed.final_reward
    if final_reward is None:
        final_reward = reward_value("reward_fillna_value", reward_fillna_value)
        _count(counts, "training/n_rollouts_reward_filled")
    else:
        _count(counts, "training/n_rollouts_w_reward")
    stamps = [
        stamp for e in events if isinstance(e, Mapping) if (stamp := _time(e.get("timestamp"), counts)) is not None
    ]
    rollout = CompletedRollout(
        rollout_id=request.rollout_id,
        group_id=request.group_id,
        state=state,
        triplets=parsed.triplets,
        final_reward=final_reward,
        step=request.step,
        sample_index=request.sample_index,
        is_train=request.is_train,
        input=request.input,
        queued_at=_time(queued_at, counts),
        started_at=min(stamps) if stamps else None,
        ended_at=_time(ended_at, counts),
        error=error,
        attempt_id=attempt_id,
        config=request.config,
        metadata=request.metadata,
    )
    return rollout, counts


def completed_rollout_from_record(
    request: RolloutRequest, record: Mapping[str, Any], events: Sequence[Any], *, reward_fillna_value: float
) -> tuple[CompletedRollout, Counter[str]]:
    """Like :func:`completed_rollout`, reading state, error and times from the gateway's rollout record
    (the ``rollout`` object of ``GET /api/rollouts/{id}``)."""
    status = record.get("status")
    status = status if isinstance(status, Mapping) else {}
    return completed_rollout(
        request,
        events,
        state=status.get("state"),
        reward_fillna_value=reward_fillna_value,
        error=status.get("error_message"),
        attempt_id=status.get("last_attempt_id"),
        queued_at=status.get("created_at"),
        ended_at=status.get("updated_at"),
    )


FailedRolloutPolicy = Literal["skip", "train"]


def apply_failed_policy(
    rollouts: Sequence[CompletedRollout], policy: FailedRolloutPolicy, reward_fillna_value: float
) -> tuple[list[CompletedRollout], Counter[str]]:
    """Apply ``agentlightning.failed_rollout_policy`` (validated by the config schema) to terminal rollouts.

    ``skip``: a failed rollout is left out of training. ``train``: it is kept with
    ``reward_fillna_value`` as its final reward (whatever it reported), so its calls are trained
    against the fill value. Either way ``training/rollouts/n_failed_{skipped,trained}`` counts it.
    """
    counts: Counter[str] = Counter()
    kept = []
    for rollout in rollouts:
        if rollout.state != "failed":
            kept.append(rollout)
        elif policy == "skip":
            counts["training/rollouts/n_failed_skipped"] += 1
        else:
            counts["training/rollouts/n_failed_trained"] += 1
            kept.append(attrs.evolve(rollout, final_reward=reward_fillna_value))
    return kept, counts


def _summary(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    array = np.asarray(values, dtype=np.float64)
    return {
        f"{prefix}/mean": float(array.mean()),
        f"{prefix}/p50": float(np.percentile(array, 50)),
        f"{prefix}/p90": float(np.percentile(array, 90)),
        f"{prefix}/max": float(array.max()),
    }


def last_event_time(events: Sequence[Any]) -> float | None:
    """The latest usable ``timestamp`` of ``events`` (their agent's last call or reward), if any."""
    stamps = []
    for event in events:
        if isinstance(event, Mapping) and event.get("timestamp") is not None:
            try:
                stamps.append(timestamp("timestamp", event["timestamp"]))
            except DataValidationError:
                continue  # counted once, by completed_rollout
    return max(stamps) if stamps else None


def source_metrics(n_finished: int, seconds: float, pickups: Sequence[float]) -> dict[str, float]:
    """A rollout source's throughput over the ``seconds`` since its previous report:
    ``timing/rollout_source/rollouts_per_s`` (rollouts it finished, whatever their state, per second),
    ``timing/rollout_source/interval_s``, and ``timing/rollout_source/pickup_s/{mean,p50,p90,max}``:
    for each rollout read from the gateway, the seconds from its last event to the source reading it
    (how long a finished rollout waited for the trainer; gateway and trainer clocks)."""
    metrics = {
        "timing/rollout_source/interval_s": float(seconds),
        "timing/rollout_source/rollouts_per_s": n_finished / seconds if seconds > 0 else 0.0,
    }
    metrics.update(_summary("timing/rollout_source/pickup_s", list(pickups)))
    return metrics


def rollout_timing_metrics(rollouts: Sequence[CompletedRollout]) -> dict[str, float]:
    """``timing/rollout_{queue_wait_s,run_duration_s,total_s}/{mean,p50,p90,max}`` over the rollouts
    whose timestamps are known (queue wait: queued → first event; run: first event → end)."""
    waits, runs, totals = [], [], []
    for r in rollouts:
        if r.queued_at is not None and r.started_at is not None:
            waits.append(max(0.0, r.started_at - r.queued_at))
        if r.started_at is not None and r.ended_at is not None:
            runs.append(max(0.0, r.ended_at - r.started_at))
        if r.queued_at is not None and r.ended_at is not None:
            totals.append(max(0.0, r.ended_at - r.queued_at))
    return {
        **_summary("timing/rollout_queue_wait_s", waits),
        **_summary("timing/rollout_run_duration_s", runs),
        **_summary("timing/rollout_total_s", totals),
    }
