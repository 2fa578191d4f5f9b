"""Peak memory of a tree pack's pass against the padded rows, side by side in one run (torch backend, CPU).

The workload is one GRPO group at agent scale: ``--group`` responses of ``L/2`` tokens after one
prompt of ``L/2`` tokens, for each row length ``L`` of ``--lengths``. Prefix sharing would compute the
prompt once in one tree pack of ``L/2 × (group + 1)`` tokens, whose attention mask (and the scores of
an attention that cannot skip masked pairs) has the square of that in elements. The cost model is set
to share every prefix (``per_pair=0``: a model whose weights' work dwarfs its attention's, as a large
one's does), so that the tree forms whenever the bound lets it.

Sides, each in a process of its own (its peak RSS is its own): ``padded`` (``share_prefixes: false``),
``bounded`` (sharing with ``agentlightning.torch.max_tree_tokens`` at its default) and ``unbounded``
(sharing with ``max_tree_tokens: null``, run only where its tree has at most ``--unbounded-up-to``
tokens: at 16k-token rows it took 16 GB). Each side runs the old-log-prob pass and one update
(forward, backward, SGD; ``per_rollout_mean``) on the recorded traces' tiny Qwen2, with every row in
one micro-batch.

    python benchmarks/bench_tree_memory.py                       # 8k, 16k and 32k-token rows
    python benchmarks/bench_tree_memory.py --lengths 4096 --group 8
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from agl_core.backends.micro_batching import UpdateBatch  # noqa: E402
from agl_core.backends.torch.backend import load_policy  # noqa: E402
from agl_core.backends.torch.update import ActorSettings, ActorUpdate  # noqa: E402
from agl_core.config import load_config  # noqa: E402
from agl_core.data import TrainingRow  # noqa: E402
from agl_core.plugins import PluginManager  # noqa: E402
from agl_core.stages.prefix_sharing import PackCost  # noqa: E402
from agl_core.stages.tensorize import tensorize  # noqa: E402

QWEN = REPO_ROOT / "tests" / "fixtures" / "gateway_traces" / "tiny_qwen2"
SIDES = ("padded", "bounded", "unbounded")


def group_rows(length: int, group: int) -> list[TrainingRow]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 1000, length // 2)
    return [
        TrainingRow(
            prompt_ids=prompt,
            response_ids=rng.integers(3, 1000, length // 2),
            response_mask=np.ones(length // 2),
            reward=1.0,
            rollout_id=f"r{i}",
            group_id="g",
        )
        for i in range(group)
    ]


def run_side(side: str, length: int, group: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = load_policy(QWEN, torch.device("cpu"))
    rows = group_rows(length, group)
    budget = max(length * group, 16384)  # every row in one micro-batch (and no less than the config allows)
    config = load_config(
        overrides=[
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
            f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={budget}",
            "actor_rollout_ref.actor.grad_clip=1e9",
            f"agentlightning.torch.share_prefixes={side != 'padded'}",
            *(["agentlightning.torch.max_tree_tokens=null"] if side == "unbounded" else []),
        ]
    )
    torch_config = config.agentlightning.torch
    settings = ActorSettings.from_config(
        config.actor_rollout_ref, torch_config.share_prefixes, torch_config.max_tree_tokens
    )
    loss = PluginManager(load_entrypoints=False).policy_losses.get("per_rollout_mean")
    update = ActorUpdate(
        model, None, torch.optim.SGD(model.parameters(), lr=1.0), loss, settings, torch.device("cpu"), 0
    )
    if update.pack_cost is not None:
        update.pack_cost = PackCost(update.pack_cost.per_token, 0.0)
    tensors = tensorize(rows).tensors
    started = time.process_time()
    with torch.no_grad():
        old = update.log_probs(model, tensors, budget, "budget")
    mask = tensors["response_mask"]
    metrics = update.mini_batch_step(UpdateBatch(tensors, mask / float(mask.sum()), old, None))
    return {
        "cpu_s": time.process_time() - started,
        "computed_tokens": metrics["perf/n_real_tokens"],
        "passes": metrics["actor/n_micro_batches"],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384, 32768], help="row lengths (tokens)")
    parser.add_argument("--group", type=int, default=4, help="responses after the shared prompt")
    parser.add_argument("--unbounded-up-to", type=int, default=40_000, help="the longest unbounded tree run")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        side, length, group = args.child
        print(json.dumps(run_side(side, int(length), int(group))))
        return
    default_bound = load_config().agentlightning.torch.max_tree_tokens
    print(f"max_tree_tokens default {default_bound}; one group of {args.group} responses after a shared prompt")
    print("| row tokens | tree tokens | side | computed tokens | passes | CPU s | peak RSS MB | × padded RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        tree = length // 2 * (args.group + 1)
        padded_rss = None
        for side in SIDES:
            if side == "unbounded" and tree > args.unbounded_up_to:
                print(f"| {length:,} | {tree:,} | {side} | not run: a {tree:,}-token tree | | | | |")
                continue
            out = subprocess.run(
                [sys.executable, __file__, "--child", side, str(length), str(args.group)],
                check=True,
                capture_output=True,
                text=True,
            )
            result = json.loads(out.stdout.strip().splitlines()[-1])
            padded_rss = padded_rss or result["peak_rss_mb"]
            print(
                f"| {length:,} | {tree:,} | {side} | {result['computed_tokens']:,.0f} | {result['passes']:.0f}"
                f" | {result['cpu_s']:.1f} | {result['peak_rss_mb']:,.0f} | {result['peak_rss_mb'] / padded_rss:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
