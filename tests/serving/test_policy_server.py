"""The in-process policy server answers like vLLM: token ids, raw log-probs, chat template, batching."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agl_core.rollouts.events import parse_events
from agl_core.serving.policy_server import PolicyServer
from agl_core.serving.sampling import SamplingParams


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    server = PolicyServer(model, tokenizer, "tiny", seed=0)
    server.start()
    yield server, model, tokenizer
    server.close()


def _chat(server, **extra):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "What is 1 + 2?"}], "max_tokens": 6, **extra}
    return httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)


def _recomputed_log_probs(model, prompt_ids, response_ids):
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return [float(log_probs[len(prompt_ids) - 1 + i, t]) for i, t in enumerate(response_ids)]


def test_chat_response_has_vllm_shape_and_true_log_probs(served):
    server, model, tokenizer = served
    body = _chat(server, return_token_ids=True, logprobs=True).json()
    messages = [{"role": "user", "content": "What is 1 + 2?"}]
    expected_prompt = tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )["input_ids"]
    assert body["prompt_token_ids"] == list(expected_prompt)
    choice = body["choices"][0]
    assert 1 <= len(choice["token_ids"]) <= 6
    given = [c["logprob"] for c in choice["logprobs"]["content"]]
    assert given == pytest.approx(_recomputed_log_probs(model, body["prompt_token_ids"], choice["token_ids"]), abs=1e-4)
    # the events parser (shared with the gateway path) reads it as one Triplet with log-probs
    parsed = parse_events(
        [{"event_type": "model_request", "data": {"response": body, "http_status": 200, "status": "ok"}}]
    )
    assert parsed.triplets[0].response_ids.tolist() == choice["token_ids"]
    assert parsed.triplets[0].response_log_probs is not None


def test_ids_and_log_probs_only_when_asked(served):
    body = _chat(served[0]).json()
    assert "prompt_token_ids" not in body and "token_ids" not in body["choices"][0]
    assert body["choices"][0]["logprobs"] is None


def test_completions_with_token_prompt(served):
    server, model, _ = served
    body = httpx.post(
        f"{server.base_url}/completions",
        json={"prompt": [21, 225, 22], "max_tokens": 4, "logprobs": 1, "return_token_ids": True, "temperature": 0},
        timeout=60,
    ).json()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == [21, 225, 22]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        _recomputed_log_probs(model, [21, 225, 22], choice["token_ids"]), abs=1e-4
    )
    # temperature 0 is greedy: the same answer twice
    again = httpx.post(
        f"{server.base_url}/completions",
        json={"prompt": [21, 225, 22], "max_tokens": 4, "temperature": 0, "return_token_ids": True},
        timeout=60,
    ).json()
    assert again["choices"][0]["token_ids"] == choice["token_ids"]


def test_stop_string_ends_generation_and_is_cut_from_text(served):
    server = served[0]
    text = httpx.post(
        f"{server.base_url}/completions", json={"prompt": [21, 225, 22], "max_tokens": 12, "temperature": 0}, timeout=60
    ).json()["choices"][0]["text"]
    stop = text[2:4] if len(text) >= 4 else text[-1]
    body = httpx.post(
        f"{server.base_url}/completions",
        json={"prompt": [21, 225, 22], "max_tokens": 12, "temperature": 0, "stop": [stop]},
        timeout=60,
    ).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert stop not in choice["text"] and text.startswith(choice["text"])


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": "hi"}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "other"}, 404, "model"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": True}, 400, "stream"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "seed": -1}, 400, "seed"),
        ({"messages": [{"role": "user", "content": "hi"}], "seed": "7"}, 400, "seed"),
    ],
)
def test_bad_requests_get_vllm_error_bodies(served, body, status, param):
    response = httpx.post(f"{served[0].base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == status
    assert response.json()["error"]["param"] == param


def test_a_request_with_an_image_is_refused_by_name(served):
    """The builtin engine generates from text only: an image would be silently dropped otherwise."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": [image, {"type": "text", "text": "?"}]}]
    response = httpx.post(f"{served[0].base_url}/chat/completions", json={"messages": messages}, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert "messages[1] has an image_url part" in error["message"] and "engine: vllm" in error["message"]


def test_concurrent_requests_are_generated_in_batches(served):
    server = served[0]
    sizes = []
    import agl_core.serving.policy_server as module

    real = module.generate_batch

    def counting(model, prompts, *args, **kwargs):
        sizes.append(len(prompts))
        return real(model, prompts, *args, **kwargs)

    module.generate_batch = counting
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            bodies = list(pool.map(lambda _: _chat(server, return_token_ids=True).json(), range(16)))
    finally:
        module.generate_batch = real
    assert all(b["choices"][0]["token_ids"] for b in bodies)
    assert sum(sizes) == 16 and max(sizes) > 1


def test_push_weights_changes_what_is_served(served, tiny_model_dir):
    server, model, tokenizer = served
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.0)  # a zero model: every token equally likely
    server.push_weights(other, version=7)
    try:
        body = _chat(server, return_token_ids=True, logprobs=True).json()
        vocab = other.config.vocab_size
        assert [c["logprob"] for c in body["choices"][0]["logprobs"]["content"]] == pytest.approx(
            [-float(torch.log(torch.tensor(float(vocab))))] * len(body["choices"][0]["token_ids"]), abs=1e-5
        )
        assert server.version == 7
    finally:
        server.push_weights(model, version=0)


def test_batched_sampling_matches_the_unbatched_distribution(served):
    """Left padding must not change what a prompt sees: greedy outputs agree batched and alone."""
    server, model, tokenizer = served
    from agl_core.serving.sampling import generate_batch

    prompts = [[21, 225, 22], [3, 89, 507, 203, 59, 76, 283, 315]]
    kwargs = dict(
        stop_token_ids=[2], pad_token_id=0, decode=tokenizer.decode, generator=torch.Generator().manual_seed(0)
    )
    together = generate_batch(model, prompts, [SamplingParams(5, temperature=0.0)] * 2, **kwargs)
    alone = [generate_batch(model, [p], [SamplingParams(5, temperature=0.0)], **kwargs)[0] for p in prompts]
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-4)


def test_a_seeded_request_samples_the_same_tokens_in_any_batch(served):
    """A request's seed fixes its tokens whatever shares its batch; unseeded requests draw from the server's stream."""
    server, model, tokenizer = served
    from agl_core.serving.sampling import generate_batch

    prompts = [[21, 225, 22], [3, 89, 507, 203, 59, 76, 283, 315], [40, 41]]
    kwargs = dict(stop_token_ids=[2], pad_token_id=0, decode=tokenizer.decode)
    seeded = [
        SamplingParams(8, temperature=1.0, seed=11),
        SamplingParams(8, temperature=1.0, seed=12),
        SamplingParams(8, temperature=1.0),
    ]
    together = generate_batch(model, prompts, seeded, generator=torch.Generator().manual_seed(0), **kwargs)
    alone = [
        generate_batch(model, [p], [s], generator=torch.Generator().manual_seed(5), **kwargs)[0]
        for p, s in zip(prompts[:2], seeded)
    ]
    assert [g.token_ids for g in together[:2]] == [g.token_ids for g in alone]
    reseeded = generate_batch(
        model, prompts[:1], [SamplingParams(8, temperature=1.0, seed=13)], generator=torch.Generator(), **kwargs
    )
    assert reseeded[0].token_ids != together[0].token_ids


def test_sampling_follows_the_distribution(served):
    """Inverse-CDF sampling draws each token with its softmax probability, nucleus-truncated by top_p."""
    from agl_core.serving.sampling import sample_tokens

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(20000, 1)
    uniforms = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    ones = torch.ones(20000)
    counts = torch.bincount(sample_tokens(logits, ones, ones, uniforms), minlength=4).float() / 20000
    assert counts.tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05], abs=0.015)
    nucleus = torch.bincount(sample_tokens(logits, ones, ones * 0.7, uniforms), minlength=4).float() / 20000
    assert nucleus.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0], abs=0.015)
    assert sample_tokens(logits[:1], torch.zeros(1), ones[:1], uniforms[:1]).item() == 0  # temperature 0 is greedy


def test_a_restored_sampler_state_samples_the_same_tokens_again(served):
    """What a checkpoint keeps of the engine: unseeded requests sample the same after a restore."""
    server = served[0]
    state = server.sampler_state()

    def sample():
        return [
            _chat(server, temperature=1.0, return_token_ids=True).json()["choices"][0]["token_ids"] for _ in range(3)
        ]

    first = sample()
    assert sample() != first  # the stream moves on
    server.restore_sampler_state(state)
    assert sample() == first
    with pytest.raises(TypeError, match="torch.Tensor"):
        server.restore_sampler_state([1, 2])
