"""The reference backend's in-process inference engine: an OpenAI-compatible server for the policy.

It answers ``/v1/chat/completions`` and ``/v1/completions`` on 127.0.0.1 the way vLLM does for RL
gateways: the prompt's token ids (top level for chat, on the choice for completions), the generated
``token_ids`` and, when ``logprobs`` is asked for, one raw log-prob per generated token
(``logprobs.content[*].logprob`` for chat, ``logprobs.token_logprobs`` for completions). Chat prompts
are rendered with the tokenizer's chat template, then tokenized without extra special tokens, as
vLLM does; generation stops at the model's end-of-sequence tokens (which are kept in ``token_ids``),
at ``stop`` strings or at ``max_tokens``. A request's ``seed`` gives it its own random stream, as
in vLLM, so the same prompt and seed sample the same tokens whichever requests share its batch.

Concurrent requests are batched: handler threads queue their prompts and one generation thread
decodes whatever is waiting as one left-padded batch with a KV cache. The server owns a copy of
the policy; :meth:`PolicyServer.push_weights` copies the trainer's weights into it between batches,
so no request is answered with a mix of weight versions.
"""

from __future__ import annotations

import copy
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from agl_core.local_http import JSONRequestHandler, LocalHTTPServer

logger = logging.getLogger(__name__)


class RequestError(Exception):
    """A request the server refuses; rendered as vLLM's error body with ``status``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        self.message = message
        self.param = param
        self.status = status
        super().__init__(message)

    def body(self) -> dict[str, Any]:
        kind = {400: "BadRequestError", 404: "NotFoundError"}.get(self.status, "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


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


# -- batched sampling ------------------------------------------------------------------------------


def _sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
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


def _uniforms(generators: Sequence[torch.Generator]) -> torch.Tensor:
    return torch.cat([torch.rand(1, generator=g) for g in generators])


@torch.no_grad()
def generate_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    *,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    decode: Any,
    generator: torch.Generator,
) -> list[Generation]:
    """Generate for every prompt at once (left-padded, KV-cached); log-probs are the raw model's.

    A prompt whose params carry a ``seed`` samples from its own generator; the others share ``generator``.
    """
    batch = len(prompts)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention[i, width - len(prompt) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    max_tokens = torch.tensor([p.max_tokens for p in params])
    stops = torch.tensor(list(stop_token_ids), dtype=torch.long)
    with_stop_strings = [i for i, p in enumerate(params) if p.stop]
    generators = [generator if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]

    out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True)
    cache = out.past_key_values
    logits = out.logits[:, -1, :].float()
    lengths = torch.zeros(batch, dtype=torch.long)  # generated tokens kept per row
    done = torch.zeros(batch, dtype=torch.bool)
    stopped = torch.zeros(batch, dtype=torch.bool)
    tokens, token_log_probs = [], []
    for step in range(int(max_tokens.max())):
        token = _sample(logits, temperature, top_p, _uniforms(generators))
        tokens.append(token)
        token_log_probs.append(torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1))
        lengths = torch.where(done, lengths, lengths + 1)
        hit_stop = torch.isin(token, stops) & ~done
        for i in with_stop_strings:
            if not done[i] and not hit_stop[i]:
                text = decode(torch.stack(tokens, 1)[i, : lengths[i]].tolist())
                hit_stop[i] = any(s in text for s in params[i].stop)
        stopped |= hit_stop
        done |= hit_stop | (lengths >= max_tokens)
        if bool(done.all()):
            break
        attention = torch.cat([attention, torch.ones((batch, 1), dtype=torch.long)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=token[:, None], attention_mask=attention, position_ids=positions, past_key_values=cache, use_cache=True
        )
        cache = out.past_key_values
        logits = out.logits[:, -1, :].float()

    all_tokens = torch.stack(tokens, 1).tolist()
    all_log_probs = torch.stack(token_log_probs, 1).tolist()
    results = []
    for i, p in enumerate(params):
        ids = all_tokens[i][: int(lengths[i])]
        text = decode(ids)
        for s in p.stop:
            if s in text:
                text = text[: text.index(s)]
        results.append(Generation(ids, all_log_probs[i][: int(lengths[i])], "stop" if stopped[i] else "length", text))
    return results


# -- the engine ---------------------------------------------------------------------------------


@attrs.define
class _Job:
    prompt_ids: list[int]
    params: SamplingParams
    done: threading.Event = attrs.field(factory=threading.Event)
    result: Generation | None = None
    error: BaseException | None = None


class PolicyServer:
    """An :class:`~agl_core.serving.engine.InferenceEngine` serving a Hugging Face causal LM in-process.

    ``model`` is copied, so the trainer may keep updating its own module; ``tokenizer`` renders chat
    prompts and decodes. ``max_batch_size`` caps how many queued requests one generation pass takes;
    ``batch_wait_s`` is how long the generation thread lingers for more requests once one arrives.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        model_name: str,
        *,
        port: int = 0,
        max_batch_size: int = 256,
        batch_wait_s: float = 0.005,
        seed: int = 0,
    ):
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.version = 0
        self._model = copy.deepcopy(model).eval()
        self._weights_lock = threading.Lock()
        self._port = port
        self._max_batch_size = max_batch_size
        self._batch_wait_s = batch_wait_s
        self._generator = torch.Generator().manual_seed(seed)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._httpd: LocalHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        config = model.config
        self.max_model_len = int(getattr(config, "max_position_embeddings", 2048))
        self._stop_token_ids = _stop_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self._stop_token_ids[0]
        self._pad_token_id = int(pad)

    @property
    def base_url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("the policy server is not started")
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def start(self) -> None:
        if self._httpd is not None:
            return
        self._httpd = LocalHTTPServer(("127.0.0.1", self._port), _handler_for(self))
        self._threads = [
            threading.Thread(target=self._httpd.serve_forever, name="policy-server-http", daemon=True),
            threading.Thread(target=self._generation_loop, name="policy-server-generate", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def push_weights(self, model: torch.nn.Module, version: int) -> None:
        with self._weights_lock, torch.no_grad():
            self._model.load_state_dict(model.state_dict())
            self.version = version

    def close(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        self._httpd = None

    def sampler_state(self) -> torch.Tensor:
        """The shared sampling generator's state (requests with a ``seed`` have their own)."""
        return self._generator.get_state()

    def restore_sampler_state(self, state: object) -> None:
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"a policy server's sampler state is a torch.Tensor, got {type(state).__name__}")
        self._generator.set_state(state)

    # -- generation -----------------------------------------------------------------------------

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Queue one prompt for the next batch and wait for its generation."""
        job = _Job(prompt_ids, params)
        self._jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def _generation_loop(self) -> None:
        while True:
            first = self._jobs.get()
            if first is None:
                return
            jobs = [first]
            deadline = time.monotonic() + self._batch_wait_s
            while len(jobs) < self._max_batch_size:
                try:
                    job = self._jobs.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if job is None:
                    self._jobs.put(None)
                    break
                jobs.append(job)
            try:
                with self._weights_lock:
                    results = generate_batch(
                        self._model,
                        [j.prompt_ids for j in jobs],
                        [j.params for j in jobs],
                        stop_token_ids=self._stop_token_ids,
                        pad_token_id=self._pad_token_id,
                        decode=self._decode,
                        generator=self._generator,
                    )
            except Exception as exc:  # answer every waiting request rather than hang them
                logger.exception("generation failed for a batch of %d requests", len(jobs))
                for job in jobs:
                    job.error = exc
                    job.done.set()
                continue
            for job, result in zip(jobs, results):
                job.result = result
                job.done.set()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- the OpenAI protocol --------------------------------------------------------------------

    def handle(self, path: str, body: Any) -> dict[str, Any]:
        """Answer one request body for ``path`` (``/v1/chat/completions`` or ``/v1/completions``)."""
        if path not in ("/v1/chat/completions", "/v1/completions"):
            raise RequestError(f"unknown route {path}", status=404)
        if not isinstance(body, Mapping):
            raise RequestError("request body must be a JSON object")
        model = body.get("model", self.model_name)
        if model != self.model_name:
            raise RequestError(f"The model `{model}` does not exist.", param="model", status=404)
        if body.get("stream"):
            raise RequestError("streaming is not supported", param="stream")
        if body.get("n", 1) != 1:
            raise RequestError("only n=1 is supported", param="n")
        chat = path == "/v1/chat/completions"
        prompt_ids = self._chat_prompt(body) if chat else self._completion_prompt(body)
        params = self._sampling_params(body, len(prompt_ids))
        result = self.generate(prompt_ids, params)
        return self._response(body, chat, prompt_ids, result)

    def _chat_prompt(self, body: Mapping[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content", ""), str):
                raise RequestError(f"messages[{i}] must be an object with a string role and content", param="messages")
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=body.get("add_generation_prompt", True)
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _completion_prompt(self, body: Mapping[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = len(self.tokenizer)
            if any(t < 0 or t >= vocab for t in prompt):
                raise RequestError(f"prompt token ids must lie in [0, {vocab})", param="prompt")
            return list(prompt)
        raise RequestError("prompt must be a string or a non-empty list of token ids", param="prompt")

    def _sampling_params(self, body: Mapping[str, Any], prompt_len: int) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise RequestError(
                f"the prompt has {prompt_len} tokens; this model's maximum context length is {self.max_model_len}",
                param="messages",
            )
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        if max_tokens is None:
            max_tokens = room
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}", param="max_tokens")
        if max_tokens > room:
            raise RequestError(
                f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceed max_model_len={self.max_model_len}",
                param="max_tokens",
            )
        temperature = _number(body, "temperature", 1.0, low=0.0)
        top_p = _number(body, "top_p", 1.0, low=1e-9, high=1.0)
        stop = body.get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop must be a string or a list of non-empty strings", param="stop")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise RequestError(f"seed must be an integer in [0, 2**63), got {seed!r}", param="seed")
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=tuple(stop), seed=seed)

    def _response(self, body: Mapping[str, Any], chat: bool, prompt_ids: list[int], result: Generation) -> dict[str, Any]:
        with_ids = bool(body.get("return_token_ids"))
        choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason, "stop_reason": None}
        tokens = self.tokenizer.convert_ids_to_tokens(result.token_ids)
        if chat:
            choice["message"] = {"role": "assistant", "content": result.text}
            if body.get("logprobs"):
                choice["logprobs"] = {
                    "content": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, result.log_probs)
                    ]
                }
            else:
                choice["logprobs"] = None
        else:
            choice["text"] = result.text
            choice["logprobs"] = (
                {"tokens": tokens, "token_logprobs": result.log_probs, "top_logprobs": None} if body.get("logprobs") else None
            )
            if with_ids:
                choice["prompt_token_ids"] = prompt_ids
        if with_ids:
            choice["token_ids"] = result.token_ids
        response: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(result.token_ids),
                "total_tokens": len(prompt_ids) + len(result.token_ids),
            },
        }
        if chat and with_ids:
            response["prompt_token_ids"] = prompt_ids
        return response


def _number(body: Mapping[str, Any], key: str, default: float, low: float, high: float | None = None) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise RequestError(f"{key} must be a number {bounds}, got {value!r}", param=key)
    return float(value)


def _stop_token_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """End-of-sequence ids: the generation config's, the model config's and the tokenizer's."""
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    if not ids:
        raise ValueError("the model defines no eos_token_id; generation could never stop early")
    return ids


def _handler_for(server: PolicyServer) -> type[JSONRequestHandler]:
    class Handler(JSONRequestHandler):
        server_label = "policy server"

        def do_GET(self) -> None:
            if self.path in ("/health", "/v1/health"):
                self.send_json(200, {})
            elif self.path == "/v1/models":
                self.send_json(200, {"object": "list", "data": [{"id": server.model_name, "object": "model", "max_model_len": server.max_model_len}]})
            else:
                self.send_json(404, RequestError(f"unknown route {self.path}", status=404).body())

        def do_POST(self) -> None:
            raw = self.read_body()
            try:
                try:
                    body = json.loads(raw) if raw else {}
                except json.JSONDecodeError as exc:
                    raise RequestError(f"request body is not valid JSON: {exc}") from None
                self.send_json(200, server.handle(self.path, body))
            except RequestError as err:
                self.send_json(err.status, err.body())
            except Exception as exc:
                logger.exception("policy server failed on %s", self.path)
                self.send_json(500, RequestError(f"internal error: {exc}", status=500).body())

    return Handler
