"""Gateway bytes → padded training tensors: agl against Agent Lightning v1.0.2, side by side in one run.

Both sides start from the HTTP bodies as the gateway sends them and end with a padded batch of
tensors, one rollout at a time as a trainer reads them:

- **v1.0**: the trainer's ``AglRolloutManagerBase._build_completed_rollout`` for every rollout,
  which decodes two bodies (the raw and the ``format=triplet`` events, with ``httpx``'s
  ``Response.json()``: the standard library's ``json``), validates them as ``Event`` models and
  builds ``CompletedRollout`` / ``Triplet`` models; then ``RolloutAdapter.get_train_data_batch``
  (rows padded to the configured maxima, a ``DataProto``). The ``format=triplet`` bodies are computed
  beforehand with the gateway's own functions.
- **agl before**: the raw events body decoded in full with ``json`` (what ``Response.json()`` did),
  ``completed_rollout_from_record``, the ``transition`` or ``trajectory`` aggregator, dropped rows
  removed, then ``tensorize`` (rows padded to the batch).
- **agl after**: the same, the body decoded by ``decode_events(body, only_parsed_fields=True)``
  (msgspec, only the fields the parser reads).
- **floor**: the fastest full JSON decoder available (``json``, ``orjson``, ``msgspec``) on the
  same raw bodies, each body decoded and dropped: no trainer that decodes the bodies in full can
  be faster.

Each side runs in its own process (so its peak RSS is its own) and reads each body from a file as it
would arrive from the network (reading is not timed). Times are CPU seconds, best of ``--repeat``;
decode and processing are reported apart. Rollouts: ``R`` rollouts × ``T`` turns; each call adds an
observation of 20-80 tokens and a response of 180-320 tokens to the context, and 5% of the turns
restart from the first prompt (a history rewrite, which breaks the trajectory merge). Every call
carries its whole prompt's ids, so the bodies grow with the square of the turns (256×8: ~66 MB,
1,024×16: ~0.7 GB). The limits are the smallest powers of two that hold the longest prompt and
response, so no row is dropped and v1.0's fixed padding is as small as it can be.

For each workload and level it prints each side's decode, processing and total time, the total as a
multiple of the floor, the peak RSS (and how much of it came after the imports), the padded/real
ratio of its batch (tensor elements per real token; in brackets, of the same rows in micro-batches
of 16,384 tokens, as the reference backend pads them), the ratios, and checks that v1.0 and both agl runs train the
same tokens (equal response ids under the response mask, row by row) with the same log-probs. v1.0
is skipped (and said so) where what it holds (its copy of the events, the models built from them
and its padded batch) would not fit in ``--v1-max-gib``.

    bash benchmarks/v1_site.sh                           # once: agentlightning 1.0.2 into .venvs/
    nice -n 19 python benchmarks/bench_vs_v1.py          # 256x8 (best of 3) and 1024x16 (once)
    python benchmarks/bench_vs_v1.py --workloads 256x8 --levels trajectory --repeat 5
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(Path(__file__).parent)]
V1_SITE = Path(os.environ.get("AGL_V1_SITE", REPO_ROOT / ".venvs" / "agentlightning-1.0.2"))

from gateway_bodies import WORKLOADS, Bodies, rollout_record  # noqa: E402

from agl_core.builtins.aggregators import trajectory, transition  # noqa: E402
from agl_core.data import RolloutRequest, TrainingRow  # noqa: E402
from agl_core.rollouts.events import completed_rollout_from_record, decode_events  # noqa: E402
from agl_core.stages.aggregation import AggregationSettings  # noqa: E402
from agl_core.stages.micro_batches import micro_batches, padded_elements  # noqa: E402
from agl_core.stages.tensorize import tensorize  # noqa: E402

REPEAT = {"256x8": 3, "1024x16": 1}  # the larger one once: ~0.7 GB of bodies per side and level
LEVELS = {"transition": transition, "trajectory": trajectory}
SIDES = ("agl-after", "agl-before", "floor", "v1")  # agl-after first: it finds the limits
MICRO_BATCH_TOKENS = 16384  # verl's default ppo_max_token_len_per_gpu
V1_BYTES_PER_ELEMENT = 80  # v1.0's peak memory per padded element: int lists + ~6 int64 tensors
V1_BYTES_PER_EVENT_INT = 72  # its own copy of the events plus the models built from them, per JSON int


def records(n_rollouts: int) -> list[dict]:
    return [rollout_record(f"r{i:06d}", i) for i in range(n_rollouts)]


def requests_for(n_rollouts: int) -> list[RolloutRequest]:
    return [
        RolloutRequest(
            rollout_id=record["rollout_id"], group_id=f"g{i // 8}", input=record["input"], sample_index=i, step=1
        )
        for i, record in enumerate(records(n_rollouts))
    ]


# -- agl -------------------------------------------------------------------------------------------


def agl_rows(
    bodies: Bodies, decode: Callable[[bytes], Any], level: str, max_lengths: tuple[int, int], timer: dict
) -> list[TrainingRow]:
    """Each body decoded (timed into ``timer["decode"]``) and parsed as it arrives, then aggregated."""
    rollouts = []
    for index, (request, record) in enumerate(zip(requests_for(len(bodies)), records(len(bodies)))):
        body = bodies.get("raw", index)
        start = time.process_time()
        events = decode(body)
        timer["decode"] += time.process_time() - start
        rollouts.append(completed_rollout_from_record(request, record, events, reward_fillna_value=0.0)[0])
    settings = AggregationSettings(max_prompt_length=max_lengths[0], max_response_length=max_lengths[1])
    return [row for row in LEVELS[level](rollouts, settings).rows if not row.dropped]


def limits(rows: list[TrainingRow]) -> tuple[int, int]:
    """The smallest powers of two holding the longest prompt and response of ``rows``."""
    longest_prompt = max(len(row.prompt_ids) for row in rows)
    longest_response = max(len(row.response_ids) for row in rows)
    return 1 << (longest_prompt - 1).bit_length(), 1 << (longest_response - 1).bit_length()


AGL_DECODERS = {"agl-before": json.loads, "agl-after": lambda body: decode_events(body, only_parsed_fields=True)}


# -- Agent Lightning v1.0.2 ------------------------------------------------------------------------


class V1:
    """v1.0's trainer-side code, imported from ``V1_SITE``, fed by an in-memory gateway."""

    def __init__(self) -> None:
        if not (V1_SITE / "agentlightning").is_dir():
            raise SystemExit(f"agentlightning 1.0.2 not found in {V1_SITE}: run `bash benchmarks/v1_site.sh` first")
        sys.path.append(str(V1_SITE))
        from agentlightning.schemas import Event, Rollout
        from agentlightning.server.routes.events import _dedupe_model_requests_by_prompt_token_ids, _to_triplet_format
        from agentlightning.verl import agl_rollout_manager, rollout_adapter

        self.Event, self.Rollout = Event, Rollout
        self.manager_class = agl_rollout_manager.AglRolloutManagerBase
        self.EnqueuedRollout = agl_rollout_manager.EnqueuedRollout
        self.RolloutAdapter = rollout_adapter.RolloutAdapter
        self._triplets = lambda events: _dedupe_model_requests_by_prompt_token_ids(
            [_to_triplet_format(e) for e in events]
        )

    def triplet_view(self, events: list[dict]) -> list[dict]:
        """The gateway's ``format=triplet`` answer for one rollout's raw events."""
        return [e.model_dump(mode="json") for e in self._triplets([self.Event.model_validate(e) for e in events])]

    def path(self, bodies: Bodies, level: str, max_lengths: tuple[int, int], timer: dict) -> dict[str, torch.Tensor]:
        manager = self.manager_class.__new__(self.manager_class)
        manager.client = _Gateway(bodies, timer)
        completed = []
        for i, record in enumerate(records(len(bodies))):
            enqueued = self.EnqueuedRollout(
                data_id=f"g{i // 8}",
                rollout_id=record["rollout_id"],
                step=1,
                sample_idx_in_step=i,
                enqueue_time=999.0,
                input=record["input"],
            )
            completed.append(manager._build_completed_rollout(enqueued, self.Rollout.model_validate(record)))
        adapter = self.RolloutAdapter(
            max_prompt_length=max_lengths[0],
            max_response_length=max_lengths[1],
            device=torch.device("cpu"),
            pad_token_id=0,
            trace_aggregator_level=level,
        )
        batch, _ = adapter.get_train_data_batch(completed, global_steps=1)
        tensors = dict(batch.batch.items())
        if "response_mask" not in tensors:  # transition rows train on the whole response
            tensors["response_mask"] = tensors["attention_mask"][:, max_lengths[0] :]
        keep = ~tensors["is_drop_mask"]
        return {k: v[keep] for k, v in tensors.items()}


class _Response:
    """An ``httpx.Response`` as v1.0 uses it: ``json()`` decodes the body with ``json``, as httpx does."""

    def __init__(self, body: bytes, timer: dict):
        self.body, self.timer = body, timer

    def raise_for_status(self) -> None:
        pass

    def json(self) -> Any:
        start = time.process_time()
        value = json.loads(self.body)
        self.timer["decode"] += time.process_time() - start
        return value


class _Gateway:
    """``client.get`` of v1.0's manager, answering ``/api/rollouts/{id}/events`` from the bodies."""

    def __init__(self, bodies: Bodies, timer: dict):
        self.bodies, self.timer = bodies, timer

    def get(self, path: str, params: dict[str, Any] | None = None) -> _Response:
        index = int(path.split("/")[3][1:])
        kind = "triplet" if (params or {}).get("format") == "triplet" else "raw"
        return _Response(self.bodies.get(kind, index), self.timer)


# -- one side, in its own process ------------------------------------------------------------------


def floor_decoders() -> dict[str, Callable[[bytes], Any]]:
    """Every full JSON decoder available here."""
    decoders: dict[str, Callable[[bytes], Any]] = {"json": json.loads}
    try:
        import orjson

        decoders["orjson"] = orjson.loads
    except ImportError:
        pass
    try:
        import msgspec

        decoders["msgspec"] = msgspec.json.Decoder().decode
    except ImportError:
        pass
    return decoders


def run_side(side: str, folder: Path, level: str, max_lengths: tuple[int, int] | None, repeat: int) -> dict[str, Any]:
    """Best of ``repeat`` runs of one side; the tensors it trains on are saved for the comparison."""
    torch.set_num_threads(1)
    bodies = Bodies(folder)
    v1 = V1() if side == "v1" else None
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if side == "floor":
        result: dict[str, Any] = {}
        for name, decode in floor_decoders().items():
            best = float("inf")
            for _ in range(repeat):
                gc.collect()
                bodies.read_s, start = 0.0, time.process_time()
                for index in range(len(bodies)):
                    decode(bodies.get("raw", index))
                best = min(best, time.process_time() - start - bodies.read_s)
            result[name] = best
        name = min(result, key=result.get)
        return {
            "decode": result[name],
            "process": 0.0,
            "total": result[name],
            "decoder": name,
            "decoders": result,
            "peak_mb": _peak_mb(),
            "start_mb": start_rss / 1024,
        }
    best: dict[str, float] | None = None
    for _ in range(repeat):
        timer = {"decode": 0.0}
        gc.collect()
        bodies.read_s, start = 0.0, time.process_time()
        if v1 is not None:
            tensors = v1.path(bodies, level, max_lengths, timer)
        else:
            rows = agl_rows(bodies, AGL_DECODERS[side], level, max_lengths or (1 << 30, 1 << 30), timer)
            if max_lengths is None:
                max_lengths = limits(rows)
            tensors = tensorize(rows).tensors
        total = time.process_time() - start - bodies.read_s
        if best is None or total < best["total"]:
            best = {"decode": timer["decode"], "process": total - timer["decode"], "total": total}
        trained_tokens, padding = trained(tensors), padded_per_real(tensors)
        del tensors
    np.savez(folder / f"{side}-{level}.npz", *[a for pair in trained_tokens for a in pair])
    return {
        **best,
        "limits": list(max_lengths),
        "rows": len(trained_tokens),
        "padding": padding,
        "peak_mb": _peak_mb(),
        "start_mb": start_rss / 1024,
    }


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def trained(tensors: dict[str, torch.Tensor]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row: the response ids and rollout log-probs under the response mask."""
    mask = tensors["response_mask"].bool()
    ids, lps = tensors["responses"], tensors["rollout_log_probs"]
    return [(ids[i][mask[i]].numpy(), lps[i][mask[i]].numpy()) for i in range(len(mask))]


def padded_per_real(tensors: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Tensor elements per real token of the batch, and of the same rows in token-budget
    micro-batches (what the reference backend pads)."""
    width = tensors["prompts"].shape[1]
    prompts = tensors["attention_mask"][:, :width].sum(1).tolist()
    responses = tensors["attention_mask"][:, width:].sum(1).tolist()
    groups = micro_batches(prompts, responses, MICRO_BATCH_TOKENS, key="MICRO_BATCH_TOKENS")
    real = sum(prompts) + sum(responses)
    return tensors["input_ids"].numel() / real, padded_elements(prompts, responses, groups) / real


def same_training(folder: Path, level: str, a: str, b: str) -> str:
    """Whether sides ``a`` and ``b`` train the same tokens with the same log-probs, row by row."""
    with np.load(folder / f"{a}-{level}.npz") as fa, np.load(folder / f"{b}-{level}.npz") as fb:
        if len(fa.files) != len(fb.files):
            return f"DIFFERENT ({len(fa.files) // 2} vs {len(fb.files) // 2} rows)"
        for i in range(0, len(fa.files), 2):
            ids_a, lp_a, ids_b, lp_b = (f[f"arr_{j}"] for f, j in ((fa, i), (fa, i + 1), (fb, i), (fb, i + 1)))
            if not np.array_equal(ids_a, ids_b) or not np.allclose(lp_a, lp_b, atol=1e-6):
                return f"DIFFERENT (row {i // 2})"
    return "same"


def side(name: str, folder: Path, level: str, max_lengths: tuple[int, int] | None, repeat: int) -> dict[str, Any]:
    command = [
        sys.executable,
        __file__,
        "--side",
        name,
        "--folder",
        str(folder),
        "--levels",
        level,
        "--repeat",
        str(repeat),
    ]
    if max_lengths is not None:
        command += ["--limits", f"{max_lengths[0]},{max_lengths[1]}"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"side {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def padding(result: dict[str, Any]) -> str:
    """``batch (micro-batched)`` padded/real of a side's tensors; the floor builds none."""
    if "padding" not in result:
        return ""
    batch, micro = result["padding"]
    return f"{batch:.2f} ({micro:.2f})"


def measure(
    v1: V1, name: str, n_rollouts: int, n_turns: int, levels: list[str], repeat: int, v1_max_gib: float
) -> None:
    with tempfile.TemporaryDirectory(prefix="agl-bench-") as tmp:
        folder = Path(tmp)
        bodies = Bodies.write(folder, n_rollouts, n_turns, v1.triplet_view)
        meta = bodies.meta
        print(
            f"\n== {name}: {n_rollouts} rollouts x {n_turns} turns; bodies: raw {meta['raw_bytes'] / 1e6:.0f} MB "
            f"(agl reads these), format=triplet {meta['triplet_bytes'] / 1e6:.0f} MB (v1.0 reads both); best of "
            f"{repeat}"
        )
        for level in levels:
            results = {"agl-after": side("agl-after", folder, level, None, repeat)}
            max_lengths = tuple(results["agl-after"]["limits"])
            results["agl-before"] = side("agl-before", folder, level, max_lengths, repeat)
            results["floor"] = side("floor", folder, level, max_lengths, repeat)
            rows = results["agl-after"]["rows"]
            v1_gib = (rows * sum(max_lengths) * V1_BYTES_PER_ELEMENT + meta["n_ints"] * V1_BYTES_PER_EVENT_INT) / 2**30
            if v1_gib <= v1_max_gib:
                results["v1"] = side("v1", folder, level, max_lengths, repeat)
            floor = results["floor"]
            print(
                f"{level:>10} (limits {max_lengths[0]}/{max_lengths[1]}, {rows} rows); floor: {floor['decoder']} "
                + ", ".join(f"{k} {v:.3f} s" for k, v in floor["decoders"].items())
            )
            print(
                f"    {'':22} {'decode s':>9} {'process s':>10} {'total s':>9} {'x floor':>8} {'peak RSS MB':>12} "
                f"{'above start':>12} {'padded/real':>12}"
            )
            labels = {
                "v1": "v1.0 (2 bodies, json)",
                "agl-before": "agl before (json)",
                "agl-after": "agl after (msgspec)",
                "floor": f"floor ({floor['decoder']})",
            }
            for key in ("v1", "agl-before", "agl-after", "floor"):
                if key not in results:
                    print(
                        f"    {labels[key]:22} skipped: it would need ~{v1_gib:.0f} GiB (> --v1-max-gib {v1_max_gib:g})"
                    )
                    continue
                r = results[key]
                print(
                    f"    {labels[key]:22} {r['decode']:9.3f} {r['process']:10.3f} {r['total']:9.3f} "
                    f"{r['total'] / floor['total']:8.2f} {r['peak_mb']:12.0f} {r['peak_mb'] - r['start_mb']:12.0f} "
                    f"{padding(r):>12}"
                )
            after = results["agl-after"]["total"]
            line = f"    agl after vs before {results['agl-before']['total'] / after:5.1f}x faster"
            if "v1" in results:
                line += f", vs v1.0 {results['v1']['total'] / after:5.1f}x faster"
            print(line)
            checks = [("agl-before", "agl-after")] + ([("v1", "agl-after")] if "v1" in results else [])
            print(
                "    trained tokens and log-probs: "
                + ", ".join(f"{a} = {b}: {same_training(folder, level, a, b)}" for a, b in checks)
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, from {list(WORKLOADS)}")
    parser.add_argument("--levels", default=",".join(LEVELS), help=f"comma-separated, from {list(LEVELS)}")
    parser.add_argument("--scales", default="1", help="rollout-count multipliers, comma-separated")
    parser.add_argument(
        "--repeat", type=int, default=None, help="timed runs per measurement (best shown; default per workload)"
    )
    parser.add_argument(
        "--v1-max-gib", type=float, default=8.0, help="skip v1.0 where its events and padded batch need more memory"
    )
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in its own process
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--limits", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        max_lengths = tuple(int(x) for x in args.limits.split(",")) if args.limits else None
        print(json.dumps(run_side(args.side, args.folder, args.levels, max_lengths, args.repeat)))
        return
    v1 = V1()
    for name in args.workloads.split(","):
        n_rollouts, n_turns = WORKLOADS[name]
        for scale in (int(s) for s in args.scales.split(",")):
            label = f"{name} x{scale}" if scale > 1 else name
            measure(
                v1,
                label,
                n_rollouts * scale,
                n_turns,
                args.levels.split(","),
                args.repeat or REPEAT[name],
                args.v1_max_gib,
            )


if __name__ == "__main__":
    main()
