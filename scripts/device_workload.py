"""The synthetic multi-turn task of ``scripts/device_check.py``: its policy, its dataset and its agent.

Nothing is downloaded. The tokenizer is word-level over the words ``w0``, ``w1``... (plus the chat
template's words and special tokens), as many as the model's vocabulary, so whatever a random
policy samples decodes to words that tokenize back to the same ids, and each rollout's calls merge
into one trajectory row. The model is a Llama at random init: a Qwen2 config would make
``AutoTokenizer`` load Qwen2's byte-level tokenizer instead of the one built here.

The agent (``device_workload:SyntheticAgent``, run by the embedded rollout source) holds a chat of
``len(observations)`` turns: each turn a user message of random words, then a reply of at most
``max_tokens`` tokens. Its reward is the share of reply words with an even index, which a random
policy gets about half right, so every group's rewards differ and GRPO has something to train on.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from agl_core.testing.word_policy import CHAT_TEMPLATE, SPECIAL_TOKENS, save_policy

__all__ = ["AGENT_CLASS", "SyntheticAgent", "build_policy", "build_tokenizer", "write_dataset"]

AGENT_CLASS = "device_workload:SyntheticAgent"
TEMPLATE_WORDS = ["system", "user", "assistant"]
SYSTEM_PROMPT = "w1 w2 w3 w4 w5 w6 w7 w8"

# One pool for every agent thread, never trimmed (see examples/corridor/agent.py for why).
_client = httpx.Client(
    timeout=300, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=None)
)


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of exactly ``vocab_size`` tokens."""
    words = [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS) - len(TEMPLATE_WORDS))]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *TEMPLATE_WORDS, *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="[UNK]",
        chat_template=CHAT_TEMPLATE,
    )


def build_policy(out_dir: Path, shape: Mapping[str, Any], device: str) -> tuple[Path, dict[str, Any]]:
    """Save a random-init Llama of ``shape`` (LlamaConfig keywords) and its tokenizer to ``out_dir``;
    return the folder and what the report says of the model. The weights are drawn on ``device``."""
    tokenizer = build_tokenizer(int(shape["vocab_size"]))
    config = LlamaConfig(
        **shape,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    save_policy(out_dir, model, tokenizer)
    return out_dir, {"architecture": "llama", **shape, "parameters": sum(p.numel() for p in model.parameters())}


def write_dataset(path: Path, n_rows: int, turns: int, words: int, max_tokens: int, vocab_size: int) -> Path:
    """``n_rows`` tasks of ``turns`` observations of ``words`` random words each."""
    rng = random.Random(0)
    n_words = vocab_size - len(SPECIAL_TOKENS) - len(TEMPLATE_WORDS)
    with path.open("w") as f:
        for i in range(n_rows):
            observations = [" ".join(f"w{rng.randrange(n_words)}" for _ in range(words)) for _ in range(turns)]
            f.write(json.dumps({"id": i, "observations": observations, "max_tokens": max_tokens}) + "\n")
    return path


def reward(words: list[str]) -> float:
    even = sum(1 for w in words if w[1:].isdigit() and int(w[1:]) % 2 == 0)
    return even / max(len(words), 1)


class SyntheticAgent:
    """The agent contract's ``run()``: ``AGL_OPENAI_BASE_URL``, ``AGL_EVENT_URL``, ``AGL_KEY`` and the
    task (the rollout input, mapped to ``DEVICE_CHECK_TASK``)."""

    def run(self) -> float:
        task = json.loads(os.environ["DEVICE_CHECK_TASK"])
        url = os.environ["AGL_OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
        headers = {"Authorization": f"Bearer {os.environ.get('AGL_KEY', '')}"}
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        replied: list[str] = []
        for observation in task["observations"]:
            messages.append({"role": "user", "content": observation})
            request = {"model": "policy", "messages": messages, "max_tokens": task["max_tokens"]}
            response = _client.post(url, headers=headers, json=request)
            response.raise_for_status()
            content = response.json()["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": content})
            replied += content.split()
        value = reward(replied)
        event = {"event_type": "reward", "data": {"value": value}}
        _client.post(os.environ["AGL_EVENT_URL"], headers=headers, json=event).raise_for_status()
        return value
