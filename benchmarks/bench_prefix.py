"""Prefix-shared forward/backward against the padded rows, side by side in one run (torch backend, CPU).

Workloads: ``bench_vs_v1``'s (``gateway_bodies``: ``R`` rollouts × ``T`` turns, each call adding an
observation of 20-80 and a response of 180-320 tokens, 5% of the turns restarting from the first
prompt; groups of 8 rollouts) and the corridor example's recorded rollouts
(``tests/fixtures/corridor_recording``: 3 steps of 4 groups × 8 rollouts × 3 turns), each at the
``transition`` and ``trajectory`` levels.

Token counts are those of the **whole** workload, from the layout alone (no model): the rows'
tokens, the unique tokens (the nodes of the rows' prefix tree), the tokens the shared side computes,
and the trained tokens. Times and memory are measured on its first ``--groups`` groups (all 8
rollouts of each, every turn: the rows keep their structure; a CPU cannot run the forward and
backward passes of 16,384 transition rows of up to 4,800 tokens): the old-log-prob pass
(``ActorUpdate.log_probs``, no gradient) and one optimizer step over all of them
(``ActorUpdate.mini_batch_step``, forward + backward + SGD, ``per_rollout_mean``), both in token-budget
micro-batches of 16,384 (verl's default), in CPU seconds of the process (on a shared machine wall
time mostly measures waiting for a core), best of ``--repeat``. Each side runs in its own process
(its peak RSS is its own), and the run prints how far apart the two sides' log-probs and gradients
are (the largest difference; the gradient's relative to its largest entry).

Models: the recorded traces' tiny Qwen2 (hidden 128, 2 layers, a 1,024-word vocabulary; the
workloads' token ids are taken modulo 1,024) and the corridor's tiny Llama (34 words).

    nice -n 19 python benchmarks/bench_prefix.py                     # everything
    python benchmarks/bench_prefix.py --workloads corridor 256x8 --levels transition --groups 2
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(Path(__file__).parent)]

from gateway_bodies import WORKLOADS, rollouts  # noqa: E402

from agl_core.backends.micro_batching import UpdateBatch  # noqa: E402
from agl_core.backends.torch.backend import load_policy  # noqa: E402
from agl_core.backends.torch.prefix_packing import RowLengths, pack_cost, row_packs  # noqa: E402
from agl_core.backends.torch.update import ActorSettings, ActorUpdate  # noqa: E402
from agl_core.builtins.aggregators import trajectory, transition  # noqa: E402
from agl_core.config import load_config  # noqa: E402
from agl_core.data import RolloutRequest, TrainingRow  # noqa: E402
from agl_core.files.recording import read_recording  # noqa: E402
from agl_core.plugins import PluginManager  # noqa: E402
from agl_core.rollouts.events import completed_rollout_from_record  # noqa: E402
from agl_core.stages.aggregation import AggregationSettings  # noqa: E402
from agl_core.stages.micro_batches import micro_batches, padded_elements  # noqa: E402
from agl_core.stages.prefix_sharing import PackCost  # noqa: E402
from agl_core.stages.tensorize import tensorize  # noqa: E402

LEVELS = {"transition": transition, "trajectory": trajectory}
BUDGET = 16384  # verl's default ppo_max_token_len_per_gpu
GROUP_SIZE = 8
QWEN = REPO_ROOT / "tests" / "fixtures" / "gateway_traces" / "tiny_qwen2"
CORRIDOR_RECORDING = REPO_ROOT / "tests" / "fixtures" / "corridor_recording"
LIMITS = AggregationSettings(max_prompt_length=1 << 20, max_response_length=1 << 20)  # nothing dropped or cut


def workload_rows(workload: str, level: str, n_groups: int | None, vocab: int) -> list[TrainingRow]:
    """The workload's rows at ``level``, of its first ``n_groups`` groups (``None``: all), token ids
    modulo ``vocab``."""
    if workload == "corridor":
        recording = read_recording(CORRIDOR_RECORDING)
        completed = [r for step in sorted(recording.steps) for r in recording.steps[step]]
        if n_groups is not None:
            keep = list(dict.fromkeys(r.group_id for r in completed))[:n_groups]
            completed = [r for r in completed if r.group_id in keep]
    else:
        n_rollouts, n_turns = WORKLOADS[workload]
        if n_groups is not None:
            n_rollouts = min(n_rollouts, n_groups * GROUP_SIZE)
        completed = []
        for i, (record, events) in enumerate(rollouts(n_rollouts, n_turns)):
            for event in events:
                data = event["data"]
                if event["event_type"] == "model_request":
                    response = data["response"]
                    response["prompt_token_ids"] = [t % vocab for t in response["prompt_token_ids"]]
                    response["choices"][0]["token_ids"] = [t % vocab for t in response["choices"][0]["token_ids"]]
            request = RolloutRequest(
                rollout_id=record["rollout_id"],
                group_id=f"g{i // GROUP_SIZE}",
                input=record["input"],
                sample_index=i,
                step=1,
            )
            completed.append(completed_rollout_from_record(request, record, events, reward_fillna_value=0.0)[0])
    return [row for row in LEVELS[level](completed, LIMITS).rows if not row.dropped]


def model_folder(workload: str, scratch: Path) -> Path:
    if workload != "corridor":
        return QWEN
    from examples.corridor.build_policy import build

    folder = scratch / "corridor_policy"
    return folder if (folder / "config.json").is_file() else build(folder)


def token_counts(workload: str, level: str, scratch: Path) -> dict[str, Any]:
    """Token counts of the whole workload at ``level``: rows, unique, computed by each side, trained."""
    model = load_policy(model_folder(workload, scratch), torch.device("cpu"))
    rows = workload_rows(workload, level, None, model.config.vocab_size)
    tensors = tensorize(rows).tensors
    lengths = RowLengths.of(tensors)
    layout = row_packs(tensors, lengths, pack_cost(model), BUDGET)
    sizes = np.array([len(p) for p in layout.packs])
    chains = np.array([p.is_chain for p in layout.packs])
    shared_padded = sum(
        padded_elements(0 * sizes[which], sizes[which], micro_batches(0 * sizes[which], sizes[which], BUDGET))
        for which in (np.flatnonzero(chains), np.flatnonzero(~chains))
        if len(which)
    )
    groups = micro_batches(lengths.prompts, lengths.responses, BUDGET)
    unique = row_packs(tensors, lengths, PackCost(per_token=1.0, per_pair=0.0), None).n_tokens  # every prefix shared
    return {
        "rows": len(rows),
        "row_tokens": int(lengths.prompts.sum() + lengths.responses.sum()),
        "unique_tokens": unique,
        "shared_tokens": layout.n_tokens,
        "trained_tokens": int(tensors["response_mask"].sum()),
        "unshared_padded": padded_elements(lengths.prompts, lengths.responses, groups),
        "shared_padded": int(shared_padded),
        "tree_packs": int((~chains).sum()),
        "packs": len(layout.packs),
    }


def run_side(side: str, workload: str, level: str, n_groups: int, repeat: int, scratch: Path) -> dict[str, Any]:
    """One side's timings on the sampled groups; its log-probs and gradient saved in ``scratch``."""
    torch.manual_seed(0)
    model = load_policy(model_folder(workload, scratch), torch.device("cpu"))
    rows = workload_rows(workload, level, n_groups, model.config.vocab_size)
    config = load_config(
        overrides=[
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={BUDGET}",
            "actor_rollout_ref.actor.grad_clip=1e9",
        ]
    )
    settings = ActorSettings.from_config(config.actor_rollout_ref, share_prefixes=side == "shared")
    loss = PluginManager(load_entrypoints=False).policy_losses.get("per_rollout_mean")
    update = ActorUpdate(
        model, None, torch.optim.SGD(model.parameters(), lr=1.0), loss, settings, torch.device("cpu"), 0
    )
    tensors = tensorize(rows).tensors
    log_prob_s, update_s = [], []
    for _ in range(repeat):
        started = time.process_time()
        with torch.no_grad():
            old = update.log_probs(model, tensors, BUDGET, "budget")
        log_prob_s.append(time.process_time() - started)
    rng = np.random.default_rng(0)
    mask = tensors["response_mask"]
    advantages = torch.as_tensor(rng.choice([-1.0, 1.0], size=(len(rows), 1)), dtype=torch.float32) * mask
    batch = UpdateBatch(tensors, advantages / float(mask.sum()), old, None)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(repeat):
        started = time.process_time()
        metrics = update.mini_batch_step(batch)
        update_s.append(time.process_time() - started)
        gradient = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())])
        with torch.no_grad():
            for b, p in zip(before, model.parameters()):
                p.copy_(b)
    np.save(scratch / f"{side}_gradient.npy", gradient.numpy())
    response = tensors["attention_mask"][:, tensors["prompts"].shape[1] :].bool()
    np.save(scratch / f"{side}_log_probs.npy", old[response].numpy())
    return {
        "rows": len(rows),
        "log_prob_s": min(log_prob_s),
        "update_s": min(update_s),
        "micro_batches": metrics["actor/n_micro_batches"],
        "padded_per_real": metrics["perf/n_padded_tokens"] / metrics["perf/n_real_tokens"],
        "computed_per_row": metrics["perf/n_real_tokens"] / metrics["perf/n_row_tokens"],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def child(args: list[str], scratch: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args, "--scratch", str(scratch)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(workload: str, level: str, n_groups: int, repeat: int, scratch: Path) -> None:
    counts = child(["counts", workload, level], scratch)
    sides = {
        side: child([side, workload, level, str(n_groups), str(repeat)], scratch) for side in ("unshared", "shared")
    }
    gradients = {side: np.load(scratch / f"{side}_gradient.npy") for side in sides}
    log_probs = {side: np.load(scratch / f"{side}_log_probs.npy") for side in sides}
    gradient_diff = np.abs(gradients["shared"] - gradients["unshared"]).max() / np.abs(gradients["unshared"]).max()
    log_prob_diff = np.abs(log_probs["shared"] - log_probs["unshared"]).max()
    trained, unique = counts["trained_tokens"], counts["unique_tokens"]
    print(
        f"\n{workload}, {level}: {counts['rows']:,} rows, {counts['row_tokens']:,} row tokens,"
        f" {unique:,} unique, {counts['shared_tokens']:,} computed shared"
        f" ({counts['packs']:,} packs, {counts['tree_packs']:,} trees), {trained:,} trained;"
        f" timed on {sides['shared']['rows']:,} rows ({n_groups} groups)."
        f" shared - unshared: log-probs {log_prob_diff:.1e}, gradient {gradient_diff:.1e} of its largest entry"
    )
    print(
        "| side | computed / trained | computed / unique | padded / computed"
        " | log-prob s | update s | × update | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for side, result in sides.items():
        computed = counts["row_tokens"] if side == "unshared" else counts["shared_tokens"]
        padded = counts["unshared_padded"] if side == "unshared" else counts["shared_padded"]
        speedup = sides["unshared"]["update_s"] / result["update_s"]
        print(
            f"| {side} | {computed / trained:.2f} | {computed / unique:.2f}"
            f" | {padded / computed:.3f} | {result['log_prob_s']:.2f} | {result['update_s']:.2f}"
            f" | {speedup:.2f} | {result['peak_rss_mb']:,.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["corridor", *WORKLOADS])
    parser.add_argument("--levels", nargs="+", default=list(LEVELS))
    parser.add_argument(
        "--groups", type=int, default=None, help="groups timed (default: 4 of 256x8, 1 of 1024x16, all 12 of corridor)"
    )
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, workload, level, *rest = args.child
        if kind == "counts":
            result = token_counts(workload, level, args.scratch)
        else:
            result = run_side(kind, workload, level, int(rest[0]), int(rest[1]), args.scratch)
        print(json.dumps(result))
        return
    default_groups = {"256x8": 4, "1024x16": 1, "corridor": 12}
    with tempfile.TemporaryDirectory() as scratch:
        for workload in args.workloads:
            for level in args.levels:
                n_groups = args.groups if args.groups is not None else default_groups[workload]
                measure(workload, level, n_groups, args.repeat, Path(scratch))


if __name__ == "__main__":
    main()
