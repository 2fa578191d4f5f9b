"""Training-step time of the reference backend: with and without token-budget micro-batches, and in each
training mode (full fine-tune in fp32 and bf16, LoRA, LoRA with gradient checkpointing), in one run.

A multi-turn chat workload of varied lengths on a small local policy: a 4-layer Llama (hidden 128)
with a 32,000-word vocabulary, random weights, and a word-level tokenizer trained here on a generated
corpus (nothing is downloaded). Each rollout is a conversation of 1-6 turns; every turn the agent
sends the whole history plus a user message of 5-160 words, and asks for a reply of 4-32 tokens. The
embedded rollout source runs the agents against the in-process policy server, the trajectory
aggregator merges each conversation into one row, and GRPO + ``per_rollout_mean`` trains it.

The same steps (same seed, same data) run twice: padded to the batch's longest prompt and response
(the default), then with ``actor_rollout_ref.actor.use_dynamic_bsz`` (and the log-prob passes
following it) under a token budget. It prints, per mode, the mean seconds per step of generation
(``timing/gen_s``), old log-probs (``timing/log_prob_s``) and the actor update
(``timing/actor_update_s``), the update's padded tensor elements per real token
(``perf/padded_per_real_tokens``), its micro-batches per step, and the ratios of the two modes.

Then the same steps run in each training mode of :data:`TRAINING_MODES`, set by verl's keys, each in a
process of its own so that its peak resident memory is its own: per mode the seconds per step of
generation, log-probs and update, trained tokens per second, the training state (weights, gradients
and AdamW moments, counted from the tensors) and the process's peak resident memory, with every ratio
to the fp32 full fine-tune. bf16 on a CPU is emulated by most kernels, so its times here say nothing
of a GPU's; the memory columns carry over.

    python benchmarks/bench_step.py                 # 2 steps a mode, both comparisons
    python benchmarks/bench_step.py --steps 4 --budget 2048 --rollouts 8 --compare micro-batches
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

VOCAB = 32_000
TURNS, REPLY_TOKENS, USER_WORDS = (1, 7), (4, 33), (5, 161)
BF16 = ["actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"]
LORA = ["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32"]
# The training modes compared, as verl's keys set them (LoRA over bf16 base weights, as on a GPU).
TRAINING_MODES = {
    "full fp32": [],
    "full bf16": BF16,
    "lora bf16": [*BF16, *LORA],
    "lora bf16 + checkpointing": [*BF16, *LORA, "actor_rollout_ref.model.enable_gradient_checkpointing=true"],
}
MIB = 2**20


# -- the policy -------------------------------------------------------------------------------------


def words(n: int) -> list[str]:
    """``n`` distinct lowercase pseudo-words (the corpus the tokenizer is trained on)."""
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    out: set[str] = set()
    while len(out) < n:
        out.add("".join(rng.choice(letters, size=int(rng.integers(3, 9)))))
    return sorted(out)


def build_policy(folder: Path) -> Path:
    """A 4-layer Llama with a trained word-level tokenizer of ``VOCAB`` tokens, saved in ``folder``."""
    from agl_core.testing.word_policy import SPECIAL_TOKENS, llama_policy, save_policy, word_tokenizer

    tokenizer = word_tokenizer(words(VOCAB - len(SPECIAL_TOKENS) - 3) + ["system user assistant"], vocab_size=VOCAB)
    model = llama_policy(
        tokenizer,
        0,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return save_policy(folder, model, tokenizer)


# -- the agent (run by the embedded rollout source) -------------------------------------------------


class ChatAgent:
    """A conversation whose turn count, user messages and reply lengths come from the rollout input."""

    def run(self) -> float:
        import httpx

        base_url = os.environ["AGL_OPENAI_BASE_URL"].rstrip("/")
        headers = {"Authorization": f"Bearer {os.environ.get('AGL_KEY', '')}"}
        turns = json.loads(os.environ["BENCH_TURNS"])
        messages: list[dict[str, str]] = [{"role": "system", "content": "you are a chat partner"}]
        replies = []
        with httpx.Client(timeout=300) as client:
            for turn in turns:
                messages.append({"role": "user", "content": turn["user"]})
                body = {"model": "policy", "messages": messages, "max_tokens": turn["max_tokens"]}
                response = client.post(f"{base_url}/chat/completions", headers=headers, json=body)
                response.raise_for_status()
                reply = response.json()["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": reply})
                replies.append(reply)
            reward = float(sum(len(r.split()) for r in replies) % 5) / 4  # varies within a group
            client.post(
                os.environ["AGL_EVENT_URL"], headers=headers, json={"event_type": "reward", "data": {"value": reward}}
            ).raise_for_status()
        return reward


def dataset(path: Path, n_rows: int) -> Path:
    rng = np.random.default_rng(1)
    vocabulary = words(VOCAB - 10)
    with open(path, "w") as out:
        for i in range(n_rows):
            turns = [
                {
                    "user": " ".join(rng.choice(vocabulary, size=int(rng.integers(*USER_WORDS)))),
                    "max_tokens": int(rng.integers(*REPLY_TOKENS)),
                }
                for _ in range(int(rng.integers(*TURNS)))
            ]
            out.write(json.dumps({"id": i, "turns": turns}) + "\n")
    return path


# -- the run ------------------------------------------------------------------------------------------


def run_mode(
    policy: Path, data: Path, run_dir: Path, steps: int, rollouts: int, extra: list[str]
) -> tuple[list[dict[str, float]], Any]:
    from agl_core.backends.torch.backend import TorchBackend
    from agl_core.config import load_config
    from agl_core.plugins import PluginManager

    config = load_config(
        overrides=[
            "agentlightning.backend=torch",
            "agentlightning.local.agent_class=benchmarks.bench_step:ChatAgent",
            "agentlightning.local.env_map.BENCH_TURNS=input.turns",
            "agentlightning.trace_aggregator.level=trajectory",
            "agentlightning.trace_aggregator.trajectory_max_prompt_length=512",
            "agentlightning.trace_aggregator.trajectory_max_response_length=1536",
            "agentlightning.torch.device=cpu",
            f"agentlightning.torch.num_threads={os.cpu_count()}",
            f"actor_rollout_ref.model.path={policy}",
            f"data.train_files={data}",
            f"data.train_batch_size={rollouts}",
            "data.shuffle=false",
            "actor_rollout_ref.rollout.n=4",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={rollouts}",  # one optimizer step on all the rows
            "actor_rollout_ref.actor.optim.lr=1e-5",
            f"trainer.total_training_steps={steps}",
            f"trainer.default_local_dir={run_dir}",
            "trainer.val_before_train=false",
            "trainer.resume_mode=disable",
            *extra,
        ]
    )
    backend = TorchBackend(config, PluginManager.from_config(config, (), load_entrypoints=False))
    metrics: list[dict[str, float]] = []
    backend.fit(lambda step, total, m, samples=None: metrics.append(dict(m)))
    return metrics, backend


def summary(metrics: list[dict[str, float]]) -> dict[str, float]:
    names = [
        "timing/gen_s",
        "timing/log_prob_s",
        "timing/actor_update_s",
        "perf/padded_per_real_tokens",
        "actor/n_micro_batches",
        "perf/total_num_tokens",
    ]
    return {name: float(np.mean([m[name] for m in metrics])) for name in names}


def training_state_mib(backend: Any) -> float:
    """The weights, gradients and AdamW moments the trainer holds, counted from their tensors."""
    import torch

    weights = sum(p.numel() * p.element_size() for p in backend.model.parameters())
    gradients = sum(p.numel() * p.element_size() for p in backend.model.parameters() if p.requires_grad)
    moments = sum(
        t.numel() * t.element_size()
        for state in backend.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t)
    )
    return (weights + gradients + moments) / MIB


def training_mode(
    policy: Path, data: Path, run_dir: Path, steps: int, rollouts: int, extra: list[str]
) -> dict[str, float]:
    """One training mode's summary, its training state and this process's peak resident memory (run
    in a fresh process per mode)."""
    metrics, backend = run_mode(policy, data, run_dir, steps, rollouts, extra)
    return {
        **summary(metrics),
        "state_mib": training_state_mib(backend),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux reports KiB
    }


def compare_micro_batches(policy: Path, data: Path, folder: Path, args: argparse.Namespace) -> None:
    modes = {
        "padded to the batch": [],
        f"micro-batches <= {args.budget} tokens": [
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.budget}",
        ],
    }
    results = {
        name: summary(run_mode(policy, data, folder / f"run{i}", args.steps, args.rollouts, extra)[0])
        for i, (name, extra) in enumerate(modes.items())
    }
    print(f"\n{args.steps} steps a mode, {args.rollouts} x 4 rollouts a step; mean seconds per step")
    print(f"{'mode':<32} {'gen s':>8} {'log-prob s':>11} {'update s':>9} {'padded/real':>12} {'micro-batches':>14}")
    for name, r in results.items():
        print(
            f"{name:<32} {r['timing/gen_s']:8.2f} {r['timing/log_prob_s']:11.2f} {r['timing/actor_update_s']:9.2f} "
            f"{r['perf/padded_per_real_tokens']:12.2f} {r['actor/n_micro_batches']:14.1f}"
        )
    plain, micro = results.values()
    print(
        f"ratio (padded / micro-batched): gen {plain['timing/gen_s'] / micro['timing/gen_s']:.2f}x, "
        f"log-prob {plain['timing/log_prob_s'] / micro['timing/log_prob_s']:.2f}x, "
        f"update {plain['timing/actor_update_s'] / micro['timing/actor_update_s']:.2f}x, "
        f"padded/real {plain['perf/padded_per_real_tokens'] / micro['perf/padded_per_real_tokens']:.2f}x"
    )


def compare_training_modes(policy: Path, data: Path, folder: Path, args: argparse.Namespace) -> None:
    results = {}
    for i, (name, extra) in enumerate(TRAINING_MODES.items()):
        # A fresh process per mode (spawned: no inherited torch state), so each peak RSS is the mode's own.
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results[name] = pool.submit(
                training_mode, policy, data, folder / f"mode{i}", args.steps, args.rollouts, extra
            ).result()
    print(
        f"\n{args.steps} steps a mode, {args.rollouts} x 4 rollouts a step;"
        " mean seconds per step, and each ratio to full fp32"
    )
    print(
        f"{'mode':<27} {'gen s':>7} {'log-prob s':>11} {'update s':>9} {'trained tok/s':>14}"
        f" {'state MiB':>10} {'peak RSS MiB':>13}"
        f" {'x update':>9} {'x state':>8} {'x RSS':>6}"
    )
    base = results["full fp32"]
    for name, r in results.items():
        trained_per_s = r["perf/total_num_tokens"] / (r["timing/log_prob_s"] + r["timing/actor_update_s"])
        print(
            f"{name:<27} {r['timing/gen_s']:7.2f} {r['timing/log_prob_s']:11.2f} {r['timing/actor_update_s']:9.2f}"
            f" {trained_per_s:14.0f} {r['state_mib']:10.1f} {r['peak_rss_mib']:13.0f}"
            f" {r['timing/actor_update_s'] / base['timing/actor_update_s']:9.2f}"
            f" {r['state_mib'] / base['state_mib']:8.2f} {r['peak_rss_mib'] / base['peak_rss_mib']:6.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="training steps per mode")
    parser.add_argument(
        "--budget", type=int, default=4096, help="ppo_max_token_len_per_gpu (padded tokens per micro-batch)"
    )
    parser.add_argument("--rollouts", type=int, default=4, help="dataset rows per step (each run rollout.n = 4 times)")
    parser.add_argument(
        "--compare", choices=("all", "micro-batches", "modes"), default="all", help="which comparison to run"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        policy = build_policy(folder / "policy")
        data = dataset(folder / "train.jsonl", args.rollouts * args.steps)
        if args.compare in ("all", "micro-batches"):
            compare_micro_batches(policy, data, folder, args)
        if args.compare in ("all", "modes"):
            compare_training_modes(policy, data, folder, args)


if __name__ == "__main__":
    main()
