"""Batched sampling for the in-process policy server: left-padded, KV-cached decoding of many prompts.

Log-probs are the raw model's (before temperature and top-p), as vLLM returns them. Each row's token
is drawn by inverting its nucleus's cumulative distribution with one uniform draw, from the row's own
generator when its request has a ``seed``, so a seeded request samples the same tokens whichever
requests share its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

__all__ = ["Generation", "SamplingParams", "generate_batch", "sample_tokens"]


@attrs.frozen
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None


@attrs.frozen
class Generation:
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" or "length"
    text: str


def sample_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """One token per row: greedy where temperature is 0, else nucleus sampling at that temperature.

    ``uniforms`` holds one draw in [0, 1) per row; inverting the nucleus's cumulative distribution
    with it makes each row's token depend on its own draw alone.
    """
    greedy = logits.argmax(-1)
    probs = torch.softmax(logits / temperature.clamp(min=1e-5)[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs > top_p[:, None]
    cdf = sorted_probs.masked_fill(outside, 0.0).cumsum(-1)
    picked = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).clamp(max=logits.shape[-1] - 1)
    sampled = order.gather(-1, picked).squeeze(-1)
    return torch.where(temperature > 0, sampled, greedy)


def _left_padded(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask of the prompts, right-aligned so every row's next token is last."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention[i, width - len(prompt) :] = 1
    return input_ids, attention


@attrs.define
class _Decoding:
    """What the decode loop has produced so far, per row."""

    tokens: list[torch.Tensor]
    log_probs: list[torch.Tensor]
    lengths: torch.Tensor  # generated tokens kept per row
    done: torch.Tensor
    stopped: torch.Tensor  # ended on a stop token or string (else: max_tokens)

    def results(self, params: Sequence[SamplingParams], decode: Callable[[list[int]], str]) -> list[Generation]:
        all_tokens = torch.stack(self.tokens, 1).tolist()
        all_log_probs = torch.stack(self.log_probs, 1).tolist()
        results = []
        for i, p in enumerate(params):
            n = int(self.lengths[i])
            ids = all_tokens[i][:n]
            text = decode(ids)
            for s in p.stop:
                if s in text:
                    text = text[: text.index(s)]
            results.append(Generation(ids, all_log_probs[i][:n], "stop" if self.stopped[i] else "length", text))
        return results


@torch.no_grad()
def generate_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    *,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    decode: Callable[[list[int]], str],
    generator: torch.Generator,
) -> list[Generation]:
    """Generate for every prompt at once (left-padded, KV-cached); log-probs are the raw model's.

    A prompt whose params carry a ``seed`` samples from its own generator; the others share ``generator``.
    Every tensor lives on the model's device; the random draws come from the CPU generators.
    """
    batch = len(prompts)
    device = next(model.parameters()).device
    input_ids, attention = (t.to(device) for t in _left_padded(prompts, pad_token_id))
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    max_tokens = torch.tensor([p.max_tokens for p in params], device=device)
    stops = torch.tensor(list(stop_token_ids), dtype=torch.long, device=device)
    # The draws stay on the CPU generators (a seeded request samples the same tokens on every device).
    generators = [generator if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    zeros = torch.zeros(batch, dtype=torch.bool, device=device)
    state = _Decoding([], [], torch.zeros(batch, dtype=torch.long, device=device), zeros.clone(), zeros.clone())

    out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True)
    for _ in range(int(max_tokens.max())):
        logits = out.logits[:, -1, :].float()
        uniforms = torch.cat([torch.rand(1, generator=g) for g in generators]).to(device)
        token = sample_tokens(logits, temperature, top_p, uniforms)
        state.tokens.append(token)
        state.log_probs.append(torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1))
        state.lengths = torch.where(state.done, state.lengths, state.lengths + 1)
        hit_stop = _hit_stop(state, token, stops, params, decode)
        state.stopped |= hit_stop
        state.done |= hit_stop | (state.lengths >= max_tokens)
        if bool(state.done.all()):
            break
        attention = torch.cat([attention, torch.ones((batch, 1), dtype=torch.long, device=device)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=token[:, None],
            attention_mask=attention,
            position_ids=positions,
            past_key_values=out.past_key_values,
            use_cache=True,
        )
    return state.results(params, decode)


def _hit_stop(
    state: _Decoding,
    token: torch.Tensor,
    stops: torch.Tensor,
    params: Sequence[SamplingParams],
    decode: Callable[[list[int]], str],
) -> torch.Tensor:
    """The rows still running that ``token`` ends: a stop token, or a stop string in the decoded text."""
    hit = torch.isin(token, stops) & ~state.done
    for i, p in enumerate(params):
        if p.stop and not state.done[i] and not hit[i]:
            text = decode(torch.stack(state.tokens, 1)[i, : state.lengths[i]].tolist())
            hit[i] = any(s in text for s in p.stop)
    return hit
