"""The reference backend on the corridor's tiny policy, started as ``fit`` starts it, and its tensors."""

from __future__ import annotations

import json

import httpx
import torch

from agl_core.backends.torch.backend import TorchBackend
from agl_core.config import load_config
from agl_core.data import TrainingRow
from agl_core.plugins import PluginManager
from agl_core.runs.train import run
from agl_core.stages.tensorize import tensorize
from tests.helpers.corridor_policy import build_corridor_policy

CONFIG = "examples/corridor/config.yaml"
SAMPLES = [{"id": 0, "signs": ["left", "right", "left"]}, {"id": 1, "signs": ["right", "right", "left"]}]


# The corridor's learning runs (tests/e2e/test_*learns.py): their steps, and the least mean sampled
# reward over the last 5 (ten times the random policy's 0.03; the reference backend's run reaches 0.46).
LEARNING_STEPS = 20
LEARNED = 0.3


def randomise_adapter(model, seed=0):
    """LoRA's B starts at zero (the adapter does nothing yet); give it weights so it changes the policy."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))


def corridor_run(folder, steps, *extra, plugins=()):
    """``agl train`` of the corridor example for ``steps`` steps on a freshly built policy, under
    ``folder``, validated once at the end (``plugins`` given in code); its metrics lines (step 0 is
    the run's start)."""
    policy = build_corridor_policy(folder / "policy")
    run_dir = folder / "run"
    overrides = [
        f"actor_rollout_ref.model.path={policy}",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=-1",
        f"trainer.test_freq={steps}",
        "trainer.val_before_train=false",
        *extra,
    ]
    run(CONFIG, overrides, plugins, show_progress=False)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def resume_overrides(policy, run_dir, steps):
    """``agl train`` overrides for ``steps`` steps of the corridor on ``policy`` under ``run_dir``, a
    checkpoint after every step (so a second run with more steps resumes), no validation."""
    return [
        f"actor_rollout_ref.model.path={policy}",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    ]


def torch_config(policy, run_dir, *extra):
    """The corridor example's config on ``policy``, writing under ``run_dir``, two rollout groups of four."""
    return load_config(
        CONFIG,
        [
            f"actor_rollout_ref.model.path={policy}",
            f"trainer.default_local_dir={run_dir}",
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "agentlightning.torch.num_threads=1",
            *extra,
        ],
    )


class Running:
    """A backend with its engine and rollout source started, as ``fit`` starts them."""

    def __init__(self, config, plugins=()):
        self.backend = TorchBackend(config, PluginManager.from_config(config, plugins, load_entrypoints=False))
        self.backend.start()

    def close(self):
        self.backend.stop()


def served_log_probs(engine, prompt, response):
    """What the serving engine says the response's log-probs are (greedy decode of ``prompt``)."""
    body = httpx.post(
        f"{engine.base_url}/completions",
        json={"prompt": prompt, "max_tokens": len(response), "temperature": 0, "logprobs": 1, "return_token_ids": True},
        timeout=60,
    ).json()
    return body["choices"][0]["token_ids"], body["choices"][0]["logprobs"]["token_logprobs"]


def tensors_of(prompt, response, pad):
    """The backend's tensors for one prompt + response, every response token trained."""
    row = TrainingRow(
        prompt_ids=prompt,
        response_ids=response,
        response_mask=[1] * len(response),
        reward=0.0,
        rollout_id="r",
        group_id="g",
    )
    return tensorize([row], pad_token_id=pad).tensors
