"""Gateway events → padded training tensors: agl against Agent Lightning v1.0.2, side by side in one run.

Both sides start from the same rollouts as the gateway returns them (``GET /api/rollouts/{id}`` and
its raw ``/events``, decoded from JSON: chat ``model_request`` events with prompt and response token
ids and per-token log-probs, and a final ``reward``), and end with a padded batch of tensors:

- **v1.0**: the trainer's ``AglRolloutManagerBase._build_completed_rollout`` for every rollout (it
  reads the raw and the ``format=triplet`` events, validates them as ``Event`` models and builds
  ``CompletedRollout`` / ``Triplet`` models), then ``RolloutAdapter.get_train_data_batch`` (rows
  padded to the configured maxima, a ``DataProto``). The ``format=triplet`` view is computed by the
  gateway, so it is prepared untimed, with the gateway's own functions.
- **agl**: ``completed_rollout_from_record`` (events parser) for every rollout, the ``transition`` or
  ``trajectory`` aggregator, dropped rows removed, then ``tensorize`` (rows padded to the batch).

Decoding the HTTP bodies is left out of both (v1.0 decodes two bodies per rollout, agl one).
Rollouts: ``R`` rollouts × ``T`` turns; each call adds an observation of 20-80 tokens and a response
of 180-320 tokens to the context, and 5% of the turns restart from the first prompt (a history
rewrite, which breaks the trajectory merge). The limits are the smallest powers of two that hold the
longest prompt and response, so no row is dropped and v1.0's fixed padding is as small as it can be.

For each workload and level it prints both times (best of ``--repeat``), the ratio, triplets/s, the
padded/real ratio of each batch (tensor elements per real token; for agl also of the same rows in
token-budget micro-batches, as the reference backend pads them) and checks that both batches train
the same tokens (equal response ids under the response mask, row by row) and the same log-probs.
The ``×2`` / ``×4`` rows scale the rollouts; v1.0 is skipped (and said so) where what it holds (its
own copy of the events, the models built from them, and its padded batch) would not fit in
``--v1-max-gib``.

    bash benchmarks/v1_site.sh                       # once: agentlightning 1.0.2 into .venvs/
    taskset -c 1 python benchmarks/bench_vs_v1.py    # 256x8 and 1024x16, each ×1 ×2 ×4
    python benchmarks/bench_vs_v1.py --workloads 256x8 --scales 1 --repeat 5
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
V1_SITE = Path(os.environ.get("AGL_V1_SITE", REPO_ROOT / ".venvs" / "agentlightning-1.0.2"))

from agl_core.data import RolloutRequest, TrainingRow  # noqa: E402
from agl_core.rollouts.events import completed_rollout_from_record  # noqa: E402
from agl_core.stages.aggregation import AggregationSettings  # noqa: E402
from agl_core.builtins.aggregators import trajectory, transition  # noqa: E402
from agl_core.stages.micro_batches import micro_batches, padded_elements  # noqa: E402
from agl_core.stages.tensorize import tensorize  # noqa: E402

WORKLOADS = {"256x8": (256, 8), "1024x16": (1024, 16)}
LEVELS = {"transition": transition, "trajectory": trajectory}
VOCAB = 32_000
FIRST_PROMPT, OBSERVATION, RESPONSE = (64, 192), (20, 80), (180, 320)
BREAK_RATE = 0.05
MODEL = "policy"
MICRO_BATCH_TOKENS = 16384  # verl's default ppo_max_token_len_per_gpu
V1_BYTES_PER_ELEMENT = 80  # v1.0's peak memory per padded element: int lists + ~6 int64 tensors
V1_BYTES_PER_EVENT_INT = 72  # its own copy of the events plus the models built from them, per JSON int
_NO_TOP: list[Any] = []


# -- the workload: rollouts as the gateway returns them ------------------------------------------


def model_request(rollout_id: str, at: float, prompt: list[int], response: list[int], log_probs: list[float], messages: list[dict]) -> dict:
    """A chat call as the gateway records it from vLLM (the shape of the recorded traces)."""
    usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(response), "completion_tokens": len(response)}
    content = [{"token": "x", "logprob": lp, "bytes": [120], "top_logprobs": _NO_TOP} for lp in log_probs]
    message = {"role": "assistant", "content": "x" * (4 * len(response)), "refusal": None, "function_call": None}
    choice = {"index": 0, "message": message, "logprobs": {"content": content}, "finish_reason": "stop", "token_ids": response}
    body = {
        "id": f"chatcmpl-{rollout_id}-{len(prompt)}",
        "object": "chat.completion",
        "created": int(at),
        "model": MODEL,
        "choices": [choice],
        "usage": usage,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt,
    }
    data = {
        "model": MODEL,
        "model_version": 3,
        "request": {"model": MODEL, "messages": messages, "max_tokens": 512, "logprobs": True, "return_token_ids": True},
        "response": body,
        "server": {"model": MODEL, "endpoint": "http://127.0.0.1:8000/v1", "version": 3},
        "latency_ms": 850.0,
        "http_status": 200,
        "status": "ok",
        "retry_count": 0,
        "routed_experts": None,
        "usage": usage,
        "finish_reason": "stop",
    }
    return {"event_type": "model_request", "rollout_id": rollout_id, "attempt_id": "0", "timestamp": at, "data": data}


def rollout_events(rng: np.random.Generator, rollout_id: str, n_turns: int, reward: float) -> list[dict]:
    """One rollout's raw events: ``n_turns`` calls, each prompt continuing the context, then a reward."""

    def ids(bounds: tuple[int, int]) -> list[int]:
        return rng.integers(0, VOCAB, size=int(rng.integers(*bounds))).tolist()

    first = ids(FIRST_PROMPT)
    prompt, messages = first, [{"role": "user", "content": "x" * (4 * len(first))}]
    events = []
    for turn in range(n_turns):
        response = ids(RESPONSE)
        log_probs = (-rng.exponential(0.5, size=len(response))).tolist()
        events.append(model_request(rollout_id, 1000.0 + turn, prompt, response, log_probs, list(messages)))
        observation = ids(OBSERVATION)
        if rng.random() < BREAK_RATE:
            prompt, messages = first + observation, messages[:1]
        else:
            prompt = prompt + response + observation
            messages = messages + [{"role": "assistant", "content": "x" * (4 * len(response))}]
        messages = messages + [{"role": "user", "content": "x" * (4 * len(observation))}]
    events.append({"event_type": "reward", "rollout_id": rollout_id, "attempt_id": "0", "timestamp": 1000.0 + n_turns, "data": {"value": reward}})
    return events


def rollout_record(rollout_id: str, index: int) -> dict:
    """The gateway's ``GET /api/rollouts/{id}`` object of a succeeded rollout."""
    return {
        "rollout_id": rollout_id,
        "input": {"task": index},
        "is_train": True,
        "config": {"timeout_seconds": 3600, "local": None, "k8s": None},
        "metadata": {"batch_idx": 0, "sample_idx_in_batch": index},
        "status": {"state": "succeeded", "last_attempt_id": "0", "error_message": None, "version": 3, "created_at": 999.0, "updated_at": 1100.0},
    }


def workload(n_rollouts: int, n_turns: int, seed: int = 0) -> list[tuple[dict, list[dict]]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_rollouts):
        rid = f"r{i:06d}"
        out.append((rollout_record(rid, i), rollout_events(rng, rid, n_turns, float(i % 2))))
    return out


def limits(requests: list[RolloutRequest], inputs: list[tuple[dict, list[dict]]], level: str) -> tuple[int, int]:
    """The smallest powers of two holding the longest prompt and response of ``level``'s rows."""
    unlimited = (1 << 30, 1 << 30)
    rows = _rows(requests, inputs, level, unlimited)
    longest_prompt = max(len(row.prompt_ids) for row in rows)
    longest_response = max(len(row.response_ids) for row in rows)
    return 1 << (longest_prompt - 1).bit_length(), 1 << (longest_response - 1).bit_length()


# -- agl -------------------------------------------------------------------------------------------


def agl_requests(inputs: list[tuple[dict, list[dict]]]) -> list[RolloutRequest]:
    return [
        RolloutRequest(rollout_id=record["rollout_id"], group_id=f"g{i // 8}", input=record["input"], sample_index=i, step=1)
        for i, (record, _) in enumerate(inputs)
    ]


def _rows(requests, inputs, level: str, max_lengths: tuple[int, int]) -> list[TrainingRow]:
    rollouts = [
        completed_rollout_from_record(request, record, events, reward_fillna_value=0.0)[0]
        for request, (record, events) in zip(requests, inputs)
    ]
    settings = AggregationSettings(max_prompt_length=max_lengths[0], max_response_length=max_lengths[1])
    return [row for row in LEVELS[level](rollouts, settings).rows if not row.dropped]


def agl_path(requests, inputs, level: str, max_lengths: tuple[int, int]) -> dict[str, torch.Tensor]:
    return tensorize(_rows(requests, inputs, level, max_lengths)).tensors


# -- Agent Lightning v1.0.2 ------------------------------------------------------------------------


class V1:
    """v1.0's trainer-side code, imported from ``V1_SITE``, fed by an in-memory gateway."""

    def __init__(self) -> None:
        if not (V1_SITE / "agentlightning").is_dir():
            raise SystemExit(f"agentlightning 1.0.2 not found in {V1_SITE}: run `bash benchmarks/v1_site.sh` first")
        sys.path.append(str(V1_SITE))
        from agentlightning.schemas import Event, Rollout
        from agentlightning.server.routes.events import _dedupe_model_requests_by_prompt_token_ids, _to_triplet_format
        from agentlightning.verl import agl_rollout_manager, rollout_adapter

        self.Event, self.Rollout = Event, Rollout
        self.triplet_view = lambda events: _dedupe_model_requests_by_prompt_token_ids([_to_triplet_format(e) for e in events])
        self.manager_class = agl_rollout_manager.AglRolloutManagerBase
        self.EnqueuedRollout = agl_rollout_manager.EnqueuedRollout
        self.RolloutAdapter = rollout_adapter.RolloutAdapter

    def prepare(self, inputs: list[tuple[dict, list[dict]]]) -> tuple[Any, list[tuple[Any, Any]]]:
        """The gateway's side (untimed): its triplet view of every rollout; the manager's enqueue records."""
        bodies: dict[str, tuple[list[dict], list[dict]]] = {}
        pending = []
        for i, (record, events) in enumerate(inputs):
            rid = record["rollout_id"]
            triplets = self.triplet_view([self.Event.model_validate(e) for e in events])
            bodies[rid] = (events, [e.model_dump(mode="json") for e in triplets])
            enqueued = self.EnqueuedRollout(data_id=f"g{i // 8}", rollout_id=rid, step=1, sample_idx_in_step=i, enqueue_time=999.0, input=record["input"])
            pending.append((enqueued, self.Rollout.model_validate(record)))
        manager = self.manager_class.__new__(self.manager_class)
        manager.client = _Gateway(bodies)
        return manager, pending

    def path(self, manager: Any, pending: list[tuple[Any, Any]], level: str, max_lengths: tuple[int, int]) -> dict[str, torch.Tensor]:
        completed = [manager._build_completed_rollout(enqueued, rollout) for enqueued, rollout in pending]
        adapter = self.RolloutAdapter(
            max_prompt_length=max_lengths[0],
            max_response_length=max_lengths[1],
            device=torch.device("cpu"),
            pad_token_id=0,
            trace_aggregator_level=level,
        )
        batch, _ = adapter.get_train_data_batch(completed, global_steps=1)
        tensors = dict(batch.batch.items())
        if "response_mask" not in tensors:  # transition rows train on the whole response
            tensors["response_mask"] = tensors["attention_mask"][:, max_lengths[0] :]
        keep = ~tensors["is_drop_mask"]
        return {k: v[keep] for k, v in tensors.items()}


class _Response:
    def __init__(self, body: list[dict]):
        self.body = body

    def raise_for_status(self) -> None:
        pass

    def json(self) -> list[dict]:
        return self.body


class _Gateway:
    """``client.get`` of v1.0's manager, answering ``/api/rollouts/{id}/events`` from memory."""

    def __init__(self, bodies: dict[str, tuple[list[dict], list[dict]]]):
        self.bodies = bodies

    def get(self, path: str, params: dict[str, Any] | None = None) -> _Response:
        raw, triplet = self.bodies[path.split("/")[3]]
        return _Response(triplet if (params or {}).get("format") == "triplet" else raw)


# -- measuring -------------------------------------------------------------------------------------


def best_of(fn: Callable[..., Any], repeat: int, setup: Callable[[], tuple] = tuple) -> tuple[float, Any]:
    """The least CPU time of ``repeat`` runs of ``fn(*setup())`` (CPU time: the machine may be
    shared; ``setup`` is not timed) and the last result."""
    best, result = float("inf"), None
    for _ in range(repeat):
        result = None
        args = setup()
        gc.collect()
        start = time.process_time()
        result = fn(*args)
        best = min(best, time.process_time() - start)
    return best, result


def trained(tensors: dict[str, torch.Tensor]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row: the response ids and rollout log-probs under the response mask."""
    mask = tensors["response_mask"].bool()
    ids, lps = tensors["responses"], tensors["rollout_log_probs"]
    return [(ids[i][mask[i]].numpy(), lps[i][mask[i]].numpy()) for i in range(len(mask))]


def same_training(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str:
    rows_a, rows_b = trained(a), trained(b)
    if len(rows_a) != len(rows_b):
        return f"DIFFERENT ({len(rows_a)} vs {len(rows_b)} rows)"
    for i, ((ids_a, lp_a), (ids_b, lp_b)) in enumerate(zip(rows_a, rows_b)):
        if not np.array_equal(ids_a, ids_b) or not np.allclose(lp_a, lp_b, atol=1e-6):
            return f"DIFFERENT (row {i})"
    return f"same ({len(rows_a)} rows, {sum(len(ids) for ids, _ in rows_a)} trained tokens)"


def padded_per_real(tensors: dict[str, torch.Tensor]) -> float:
    return tensors["input_ids"].numel() / int(tensors["attention_mask"].sum())


def micro_batched_per_real(tensors: dict[str, torch.Tensor]) -> float:
    """Padded/real of the same rows in token-budget micro-batches (what the reference backend pads)."""
    width = tensors["prompts"].shape[1]
    prompts = tensors["attention_mask"][:, :width].sum(1).tolist()
    responses = tensors["attention_mask"][:, width:].sum(1).tolist()
    groups = micro_batches(prompts, responses, MICRO_BATCH_TOKENS, key="MICRO_BATCH_TOKENS")
    return padded_elements(prompts, responses, groups) / (sum(prompts) + sum(responses))


def _event_ints(event: dict) -> int:
    """Token ids and log-probs in one event (what dominates the memory of decoded events)."""
    if event["event_type"] != "model_request":
        return 0
    response = event["data"]["response"]
    return len(response["prompt_token_ids"]) + 2 * len(response["choices"][0]["token_ids"])


def measure(v1: V1, name: str, inputs, repeat: int, v1_max_gib: float) -> None:
    n_calls = sum(len(events) - 1 for _, events in inputs)
    n_ints = sum(_event_ints(event) for _, events in inputs for event in events)
    print(f"\n== {name}: {len(inputs)} rollouts, {n_calls} triplets")
    requests = agl_requests(inputs)
    for level in LEVELS:
        max_lengths = limits(requests, inputs, level)
        agl_s, ours = best_of(lambda: agl_path(requests, inputs, level, max_lengths), repeat)
        v1_gib = (len(ours["input_ids"]) * sum(max_lengths) * V1_BYTES_PER_ELEMENT + n_ints * V1_BYTES_PER_EVENT_INT) / 2**30
        head = f"{level:>10} (limits {max_lengths[0]}/{max_lengths[1]}, {len(ours['input_ids'])} rows)"
        agl_line = (
            f"agl  {agl_s:8.3f} s  {n_calls / agl_s:9.0f} triplets/s  padded/real {padded_per_real(ours):5.2f} "
            f"(in micro-batches of {MICRO_BATCH_TOKENS} tokens: {micro_batched_per_real(ours):4.2f})"
        )
        if v1_gib > v1_max_gib:
            print(f"{head}\n    {agl_line}\n    v1.0 skipped: it would need ~{v1_gib:.0f} GiB (> --v1-max-gib {v1_max_gib:g})")
            continue
        # v1.0 edits the event lists it is given, so every run gets its own (as from fresh JSON).
        v1_s, theirs = best_of(lambda m, p: v1.path(m, p, level, max_lengths), repeat, lambda: v1.prepare(inputs))
        print(
            f"{head}\n    v1.0 {v1_s:8.3f} s  {n_calls / v1_s:9.0f} triplets/s  padded/real {padded_per_real(theirs):5.2f}\n"
            f"    {agl_line}\n    ratio {v1_s / agl_s:5.1f}x   trained tokens and log-probs: {same_training(theirs, ours)}"
        )
        del theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, from {list(WORKLOADS)}")
    parser.add_argument("--scales", default="1,2,4", help="rollout-count multipliers, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (best shown)")
    parser.add_argument("--v1-max-gib", type=float, default=8.0, help="skip v1.0 where its events and padded batch need more memory")
    args = parser.parse_args()
    torch.set_num_threads(1)
    v1 = V1()
    for name in args.workloads.split(","):
        n_rollouts, n_turns = WORKLOADS[name]
        for scale in (int(s) for s in args.scales.split(",")):
            inputs = workload(n_rollouts * scale, n_turns)
            measure(v1, f"{name} x{scale}" if scale > 1 else name, inputs, args.repeat, args.v1_max_gib)
            del inputs


if __name__ == "__main__":
    main()
