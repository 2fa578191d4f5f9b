"""The reference backend's in-process inference engine: an OpenAI-compatible server for the policy.

It answers ``/v1/chat/completions`` and ``/v1/completions`` on 127.0.0.1 the way vLLM does for RL
gateways: the prompt's token ids (top level for chat, on the choice for completions), the generated
``token_ids`` and, when ``logprobs`` is asked for, one raw log-prob per generated token
(``logprobs.content[*].logprob`` for chat, ``logprobs.token_logprobs`` for completions). Chat prompts
are rendered with the tokenizer's chat template, then tokenized without extra special tokens, as
vLLM does; generation stops at the model's end-of-sequence tokens (which are kept in ``token_ids``),
at ``stop`` strings or at ``max_tokens``. A request's ``seed`` gives it its own random stream, as
in vLLM, so the same prompt and seed sample the same tokens whichever requests share its batch.
It generates from text only: a chat message with an ``image_url`` part is refused (400, naming it),
since a vision-language policy's rollouts need an engine that encodes images (vLLM).

Concurrent requests are batched: handler threads queue their prompts and one generation thread
decodes whatever is waiting as one left-padded batch with a KV cache
(:func:`agl_core.serving.sampling.generate_batch`). The server owns a copy of the policy;
:meth:`PolicyServer.push_weights` copies the trainer's weights into it between batches, so no
request is answered with a mix of weight versions.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from agl_core.errors import AglError, UsageError, UsageTypeError
from agl_core.fields import is_int, is_number
from agl_core.local_http import JSONRequestHandler, LocalHTTPServer
from agl_core.serving.sampling import Generation, SamplingParams, generate_batch
from agl_core.serving.weights import served_copy, served_state_dict

__all__ = ["PolicyServer", "RequestError"]

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
EVERY_INTERFACE = "0.0.0.0"


class RequestError(AglError):
    """A request the server refuses; rendered as vLLM's error body with ``status``."""

    __module__ = "agl_core"

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        self.message = message
        self.param = param
        self.status = status
        super().__init__(message)

    def body(self) -> dict[str, Any]:
        kind = {400: "BadRequestError", 404: "NotFoundError"}.get(self.status, "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


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

    ``model`` is copied (a PEFT model as its base with the adapters merged in,
    :mod:`agl_core.serving.weights`), so the trainer may keep updating its own module; ``tokenizer``
    renders chat prompts and decodes. ``max_batch_size`` caps how many queued requests one generation
    pass takes; ``batch_wait_s`` is how long the generation thread lingers for more requests once one
    arrives. ``host`` is the interface the HTTP server listens on (``0.0.0.0``: every interface, for
    clients on other machines; IPv4); ``base_url`` is how this process reaches it.
    """

    __module__ = "agl_core"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        model_name: str,
        *,
        port: int = 0,
        host: str = LOOPBACK,
        max_batch_size: int = 256,
        batch_wait_s: float = 0.005,
        seed: int = 0,
    ):
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.version = 0
        self._model = served_copy(model)
        self._weights_lock = threading.Lock()
        self._port = port
        self._host = host
        self._max_batch_size = max_batch_size
        self._batch_wait_s = batch_wait_s
        self._generator = torch.Generator().manual_seed(seed)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._httpd: LocalHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        config = model.config
        self.max_model_len = int(getattr(config, "max_position_embeddings", 2048))
        self._stop_token_ids = _stop_token_ids(self._model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self._stop_token_ids[0]
        self._pad_token_id = int(pad)

    @property
    def base_url(self) -> str:
        """The OpenAI base URL agents call, ``http://HOST:PORT/v1`` (once started)."""
        if self._httpd is None:
            raise RuntimeError("the policy server is not started")
        host = LOOPBACK if self._host == EVERY_INTERFACE else self._host
        return f"http://{host}:{self.port}/v1"

    @property
    def port(self) -> int:
        """The port the HTTP server listens on (chosen by the system when ``port`` was 0)."""
        if self._httpd is None:
            raise RuntimeError("the policy server is not started")
        return int(self._httpd.server_address[1])

    @property
    def device(self) -> torch.device:
        """The device the served copy generates on (the trained model's, when it was copied)."""
        return next(self._model.parameters()).device

    def start(self) -> None:
        """Start the HTTP server and the generation thread (idempotent), serving the weights given at
        construction as version 0 until :meth:`push_weights`."""
        if self._httpd is not None:
            return
        self._httpd = LocalHTTPServer((self._host, self._port), _handler_for(self))
        self._threads = [
            threading.Thread(target=self._httpd.serve_forever, name="policy-server-http", daemon=True),
            threading.Thread(target=self._generation_loop, name="policy-server-generate", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def push_weights(self, model: torch.nn.Module, version: int) -> None:
        """Generate with ``model``'s current weights (copied) as ``version`` from the next request on."""
        with self._weights_lock, torch.no_grad():
            self._model.load_state_dict(served_state_dict(model))
            self.version = version

    def close(self) -> None:
        """Stop serving: the HTTP server and the generation thread end (idempotent)."""
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
            raise UsageTypeError(f"a policy server's sampler state is a torch.Tensor, got {type(state).__name__}")
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
            if _has_image(m):
                raise RequestError(
                    f"messages[{i}] has an image_url part: the builtin engine generates from text only;"
                    " serve a vision-language policy with agentlightning.engine: vllm",
                    param="messages",
                )
            if (
                not isinstance(m, Mapping)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content", ""), str)
            ):
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
        if not is_int(max_tokens, minimum=1):
            raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}", param="max_tokens")
        if max_tokens > room:
            raise RequestError(
                f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceed "
                f"max_model_len={self.max_model_len}",
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
        if seed is not None and not (is_int(seed, minimum=0) and seed < 2**63):
            raise RequestError(f"seed must be an integer in [0, 2**63), got {seed!r}", param="seed")
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=tuple(stop), seed=seed)

    def _response(
        self, body: Mapping[str, Any], chat: bool, prompt_ids: list[int], result: Generation
    ) -> dict[str, Any]:
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
                {"tokens": tokens, "token_logprobs": result.log_probs, "top_logprobs": None}
                if body.get("logprobs")
                else None
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


def _has_image(message: Any) -> bool:
    content = message.get("content") if isinstance(message, Mapping) else None
    return isinstance(content, list) and any(
        isinstance(part, Mapping) and part.get("type") == "image_url" for part in content
    )


def _number(body: Mapping[str, Any], key: str, default: float, low: float, high: float | None = None) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not is_number(value) or value < low or (high is not None and value > high):
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
        raise UsageError(
            "the model (actor_rollout_ref.model.path) defines no eos_token_id in its generation config, config or "
            "tokenizer; generation could never stop early"
        )
    return ids


def _handler_for(server: PolicyServer) -> type[JSONRequestHandler]:
    class Handler(JSONRequestHandler):
        server_label = "policy server"

        def do_GET(self) -> None:
            if self.path in ("/health", "/v1/health"):
                self.send_json(200, {})
            elif self.path == "/v1/models":
                self.send_json(
                    200,
                    {
                        "object": "list",
                        "data": [{"id": server.model_name, "object": "model", "max_model_len": server.max_model_len}],
                    },
                )
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
