"""The benchmarks' workload: rollouts' events bodies as the gateway sends them, kept in files.

``R`` rollouts × ``T`` turns of chat ``model_request`` events (prompt and response token ids and
per-token log-probs, as the gateway records them from vLLM) and a final ``reward``; each call adds
an observation of 20-80 tokens and a response of 180-320 tokens to the context, and 5% of the turns
restart from the first prompt (a history rewrite). No agl import: a benchmark can load another
revision of agl beside it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

WORKLOADS = {"256x8": (256, 8), "1024x16": (1024, 16)}  # rollouts x turns
VOCAB = 32_000
FIRST_PROMPT, OBSERVATION, RESPONSE = (64, 192), (20, 80), (180, 320)
BREAK_RATE = 0.05
MODEL = "policy"
_NO_TOP: list[Any] = []


def model_request(
    rollout_id: str, at: float, prompt: list[int], response: list[int], log_probs: list[float], messages: list[dict]
) -> dict:
    """A chat call as the gateway records it from vLLM (the shape of the recorded traces)."""
    usage = {
        "prompt_tokens": len(prompt),
        "total_tokens": len(prompt) + len(response),
        "completion_tokens": len(response),
    }
    content = [{"token": "x", "logprob": lp, "bytes": [120], "top_logprobs": _NO_TOP} for lp in log_probs]
    message = {"role": "assistant", "content": "x" * (4 * len(response)), "refusal": None, "function_call": None}
    choice = {
        "index": 0,
        "message": message,
        "logprobs": {"content": content},
        "finish_reason": "stop",
        "token_ids": response,
    }
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
        "request": {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 512,
            "logprobs": True,
            "return_token_ids": True,
        },
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
    events.append(
        {
            "event_type": "reward",
            "rollout_id": rollout_id,
            "attempt_id": "0",
            "timestamp": 1000.0 + n_turns,
            "data": {"value": reward},
        }
    )
    return events


def rollout_record(rollout_id: str, index: int) -> dict:
    """The gateway's ``GET /api/rollouts/{id}`` object of a succeeded rollout."""
    return {
        "rollout_id": rollout_id,
        "input": {"task": index},
        "is_train": True,
        "config": {"timeout_seconds": 3600, "local": None, "k8s": None},
        "metadata": {"batch_idx": 0, "sample_idx_in_batch": index},
        "status": {
            "state": "succeeded",
            "last_attempt_id": "0",
            "error_message": None,
            "version": 3,
            "created_at": 999.0,
            "updated_at": 1100.0,
        },
    }


def rollouts(n_rollouts: int, n_turns: int, seed: int = 0) -> Iterator[tuple[dict, list[dict]]]:
    """``(record, raw events)`` of each rollout, generated one at a time."""
    rng = np.random.default_rng(seed)
    for i in range(n_rollouts):
        rid = f"r{i:06d}"
        yield rollout_record(rid, i), rollout_events(rng, rid, n_turns, float(i % 2))


def gateway_json(value: Any) -> bytes:
    """JSON as the gateway's server sends it (compact, as its framework's JSON responses are)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


class Bodies:
    """The workload's bodies in files: ``raw`` (``/events``) and ``triplet`` (``?format=triplet``)
    of every rollout, read back one at a time as a trainer receives them."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.meta = json.loads((folder / "meta.json").read_text())
        self.offsets = {
            kind: np.load(folder / f"{kind}.npy") for kind in ("raw", "triplet") if (folder / f"{kind}.npy").exists()
        }
        self.files = {kind: open(folder / f"{kind}.bin", "rb") for kind in self.offsets}
        self.read_s = 0.0

    @classmethod
    def write(
        cls, folder: Path, n_rollouts: int, n_turns: int, triplet_view: Callable[[list[dict]], list[dict]] | None
    ) -> Bodies:
        kinds = ("raw", "triplet") if triplet_view else ("raw",)
        offsets: dict[str, list[int]] = {kind: [0] for kind in kinds}
        n_ints = 0
        files = {kind: open(folder / f"{kind}.bin", "wb") for kind in kinds}
        for _record, events in rollouts(n_rollouts, n_turns):
            n_ints += sum(_event_ints(event) for event in events)
            bodies = {"raw": gateway_json(events)}
            if triplet_view:
                bodies["triplet"] = gateway_json(triplet_view(events))
            for kind, body in bodies.items():
                files[kind].write(body)
                offsets[kind].append(offsets[kind][-1] + len(body))
        for kind in kinds:
            files[kind].close()
            np.save(folder / f"{kind}.npy", np.asarray(offsets[kind], dtype=np.int64))
        meta = {"n_rollouts": n_rollouts, "n_turns": n_turns, "n_ints": n_ints}
        meta.update({f"{kind}_bytes": offsets[kind][-1] for kind in kinds})
        (folder / "meta.json").write_text(json.dumps(meta))
        return cls(folder)

    def __len__(self) -> int:
        return self.meta["n_rollouts"]

    def get(self, kind: str, index: int) -> bytes:
        """One body, read from its file (the time is kept apart: it stands for the network)."""
        start = time.process_time()
        begin, end = self.offsets[kind][index : index + 2]
        body = os.pread(self.files[kind].fileno(), int(end - begin), int(begin))
        self.read_s += time.process_time() - start
        return body


def _event_ints(event: dict) -> int:
    """Token ids and log-probs in one event (what dominates the memory of decoded events)."""
    if event["event_type"] != "model_request":
        return 0
    response = event["data"]["response"]
    return len(response["prompt_token_ids"]) + 2 * len(response["choices"][0]["token_ids"])
