"""A task small enough to train on in seconds, for :mod:`agl_core.testing.harness`.

Each dataset row asks for a few words, one per turn: the agent says ``say up``, the policy answers,
then ``correct . say left`` and so on. A turn earns ``1 / len(words)`` when the reply's first word
is the word asked for (posted as a reward tagged with its call, ``data.call_index``, for per-turn
estimators); the final reward is the fraction of right answers. Every rollout is a real multi-turn
trace: calls whose prompts extend the previous context, as an agent's do.

The policy is built locally, nothing downloaded: a word-level tokenizer trained on the task's texts
(so a re-rendered reply tokenizes as it was generated) and a one-layer Llama with hidden size 32 and
random weights. It learns little in a few steps; it exists to run every stage of a real training
step on CPU.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import httpx

from agl_core.testing.word_policy import llama_policy, save_policy, word_tokenizer

__all__ = ["SYSTEM_PROMPT", "WORDS", "TinyWordAgent", "build_policy", "corpus", "write_dataset"]

WORDS = ("up", "down", "left", "right")
SYSTEM_PROMPT = "answer with one word ."
WORDS_ENV = "TINY_TASK_WORDS"  # mapped from the rollout input's ``words`` (agentlightning.local.env_map)


def question(word: str, previous_correct: bool | None) -> str:
    feedback = "" if previous_correct is None else ("correct . " if previous_correct else "wrong . ")
    return f"{feedback}say {word}"


def corpus() -> list[str]:
    """Every text the task shows, for the tokenizer."""
    return [SYSTEM_PROMPT, "system user assistant", *(question(w, p) for w in WORDS for p in (None, True, False))]


class TinyWordAgent:
    """The agent, written against the Agent Lightning agent contract (``Class().run()`` with
    ``AGL_OPENAI_BASE_URL``, ``AGL_EVENT_URL`` and ``AGL_KEY`` in the environment)."""

    def run(self) -> float:
        base_url = os.environ["AGL_OPENAI_BASE_URL"].rstrip("/")
        headers = {"Authorization": f"Bearer {os.environ.get('AGL_KEY', '')}"}
        words = json.loads(os.environ[WORDS_ENV])
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        correct, rewards = None, []
        with httpx.Client(timeout=120) as client:
            for index, word in enumerate(words):
                messages.append({"role": "user", "content": question(word, correct)})
                body = {"model": "policy", "messages": messages, "max_tokens": 1}
                response = client.post(f"{base_url}/chat/completions", headers=headers, json=body)
                response.raise_for_status()
                reply = response.json()["choices"][0]["message"]["content"] or ""
                messages.append({"role": "assistant", "content": reply})
                correct = reply.split()[:1] == [word]
                rewards.append({"value": (1.0 if correct else 0.0) / len(words), "call_index": index})
            reward = sum(r["value"] for r in rewards)
            for data in [*rewards, {"value": reward}]:
                client.post(
                    os.environ["AGL_EVENT_URL"], headers=headers, json={"event_type": "reward", "data": data}
                ).raise_for_status()
        return reward


def write_dataset(path: Path, n_rows: int, n_words: int, seed: int) -> Path:
    """``n_rows`` JSON lines ``{"id": i, "words": [...]}`` of ``n_words`` words each."""
    rng = random.Random(seed)
    rows = [{"id": i, "words": [rng.choice(WORDS) for _ in range(n_words)]} for i in range(n_rows)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def build_policy(out_dir: Path, seed: int = 0) -> Path:
    """Save the tiny policy (model, tokenizer with its chat template) in ``out_dir``."""
    tokenizer = word_tokenizer(corpus())
    model = llama_policy(
        tokenizer,
        seed,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    return save_policy(out_dir, model, tokenizer)
