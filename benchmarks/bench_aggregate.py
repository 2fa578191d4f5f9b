"""Aggregation + tensorisation throughput, and padding waste against fixed maxima.

A synthetic workload shaped like agent training: ``rollouts`` rollouts of ``turns`` calls, each
call adding an observation and a response of a few hundred tokens to the context, with an
occasional history rewrite (a trajectory break). For each built-in aggregator it prints
triplets/s for aggregation alone and with tensorisation, and the ratio of padded tensor elements
to real tokens for padding to the batch (ours) and to the fixed limits (Agent Lightning v1.0's),
measured in the same run on the same rows.

    python benchmarks/bench_aggregate.py            # 256 x 8 x ~300 tokens, then the long variant
    python benchmarks/bench_aggregate.py --repeat 10

Run it on one core (``taskset -c 0``) to compare with the targets it prints.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from agl_core.stages.aggregation import AggregationSettings
from agl_core.stages.levels import trajectory, transition
from agl_core.data import CompletedRollout, Triplet
from agl_core.stages.tensorize import tensorize

VOCAB = 32_000
# Agent Lightning's default trajectory limits, the fixed padding we compare against.
DEFAULT_LIMITS = (2048, 8192)
# Transition rows carry the whole history in their prompt: a multi-turn run raises verl's
# data.max_prompt_length so the late turns are not all dropped.
TRANSITION_LIMITS = (4096, 8192)

WORKLOADS = {
    # name: (rollouts, turns, first prompt, observation, response) token ranges per call
    "256x8 (~300 tokens/turn)": (256, 8, (64, 192), (20, 80), (180, 320)),
    "long context 64x8 (~900 tokens/turn)": (64, 8, (256, 768), (100, 200), (600, 900)),
}
TARGETS_MS = {"trajectory": 100.0, "transition": 500.0}


def workload(n_rollouts: int, n_turns: int, first, observation, response, break_rate=0.05, seed=0):
    rng = np.random.default_rng(seed)

    def ids(bounds):
        return rng.integers(0, VOCAB, size=int(rng.integers(*bounds)))

    rollouts = []
    for r in range(n_rollouts):
        first_prompt = ids(first)
        prompt = first_prompt
        calls = []
        for _ in range(n_turns):
            out = ids(response)
            lp = -rng.exponential(0.5, size=len(out)).astype(np.float32)
            calls.append(Triplet(prompt_ids=prompt, response_ids=out, response_log_probs=lp))
            context = first_prompt if rng.random() < break_rate else np.concatenate([prompt, out])
            prompt = np.concatenate([context, ids(observation)])
        rollouts.append(
            CompletedRollout(
                rollout_id=f"r{r}", group_id=f"g{r // 8}", state="succeeded", triplets=calls, final_reward=float(r % 2)
            )
        )
    return rollouts


def best_ms(fn, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return min(times), statistics.median(times)


def report(name, spec, repeat):
    rollouts = workload(*spec)
    n_calls = sum(len(r.triplets) for r in rollouts)
    print(f"\n== {name}: {len(rollouts)} rollouts, {n_calls} triplets")
    for level, aggregate, limits in (
        ("trajectory", trajectory, DEFAULT_LIMITS),
        ("transition", transition, TRANSITION_LIMITS),
    ):
        settings = AggregationSettings(max_prompt_length=limits[0], max_response_length=limits[1])
        result = aggregate(rollouts, settings)
        rows = [row for row in result.rows if not row.dropped]
        agg_best, agg_median = best_ms(lambda: aggregate(rollouts, settings), repeat)
        both_best, both_median = best_ms(lambda: tensorize([r for r in aggregate(rollouts, settings).rows if not r.dropped]), repeat)

        batch = tensorize(rows)
        real = int(batch.tensors["attention_mask"].sum())
        ours = batch.tensors["input_ids"].numel()
        fixed = tensorize(rows, prompt_length=limits[0], response_length=limits[1]).tensors["input_ids"].numel()
        target = TARGETS_MS[level] if name.startswith("256x8") else None
        verdict = "" if target is None else f"  (target <= {target:.0f} ms: {'met' if both_best <= target else 'NOT met'})"
        print(
            f"{level:>10}: {len(rows)} rows ({int(result.metrics['training/n_sample_dropped/marked'])} dropped, "
            f"limits {limits[0]}/{limits[1]})\n"
            f"            aggregate        {agg_best:8.1f} ms best, {agg_median:8.1f} median -> "
            f"{n_calls / agg_best * 1000:10.0f} triplets/s\n"
            f"            + tensorise      {both_best:8.1f} ms best, {both_median:8.1f} median -> "
            f"{n_calls / both_best * 1000:10.0f} triplets/s{verdict}\n"
            f"            padded/real elements: batch-padded {ours / real:.2f} "
            f"(shape {tuple(batch.tensors['input_ids'].shape)}), fixed {fixed / real:.2f} "
            f"-> {fixed / ours:.2f}x fewer elements{'' if target is None else ' (target >= 3x)'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per measurement (best and median shown)")
    args = parser.parse_args()
    for name, spec in WORKLOADS.items():
        report(name, spec, args.repeat)


if __name__ == "__main__":
    main()
