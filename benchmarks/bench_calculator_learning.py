"""Does a real language model learn through agl? SmolLM2-135M-Instruct on the calculator task.

Held-out accuracy (the test split, greedy, never trained on) of the converted model, then ``agl
train`` of ``examples/calculator/config.yaml`` (``backend=NAME`` and any other overrides passed on),
then the held-out accuracy of the trained policy (the run's ``merged_model_dir``; on a backend that
does not merge, its last checkpoint's model: keep the last step saved with ``trainer.save_freq``).
Prints one JSON line per phase and a summary: accuracy before and after, the training's wall time,
seconds per step, tokens per second (where the backend reports ``perf/total_num_tokens``) and the
peak RSS of the training process, and writes them to ``RUN_DIR/learning.json``
beside the run's ``metrics.jsonl`` and ``metrics.png``.

    python benchmarks/bench_calculator_learning.py [--run-dir DIR] [--limit N] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from examples.calculator.evaluate import score  # noqa: E402

CONFIG = ROOT / "examples/calculator/config.yaml"


def run(command: list[str]) -> tuple[float, int]:
    """Run ``command`` from the repository root: its wall seconds and peak RSS in MiB."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed with status {os.waitstatus_to_exitcode(status)}")
    return seconds, usage.ru_maxrss // 1024


def accuracy(model_dir: Path, out: Path, limit: int | None) -> dict:
    command = [sys.executable, "examples/calculator/evaluate.py", str(model_dir), "--out", str(out)]
    seconds, _ = run(command + (["--limit", str(limit)] if limit else []))
    results = [json.loads(line) for line in out.read_text().splitlines()]
    return {**score(results), "seconds": round(seconds, 1)}


def trained_policy(run_dir: Path, merged: Path) -> Path:
    """The trained policy's folder: the run's merged model (torch backend), else the model folder of
    its newest checkpoint (the trl backend's ``global_step_N/model``)."""
    if merged.is_dir():
        return merged
    saved = sorted(run_dir.glob("global_step_*/*/config.json"), key=lambda p: int(p.parts[-3].rsplit("_", 1)[1]))
    if not saved:
        raise SystemExit(f"{run_dir} holds no trained model: no {merged.name}/ and no global_step_N/*/config.json")
    return saved[-1].parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=Path("outputs/calculator/learning"))
    parser.add_argument("--model", type=Path, default=Path("outputs/models/SmolLM2-135M-Instruct"))
    parser.add_argument("--limit", type=int, help="evaluate only the test split's first N problems")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="agl train overrides")
    args = parser.parse_args()
    run_dir = args.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "examples/calculator/setup_model.py", str(args.model)])
    before = accuracy(args.model, run_dir / "test_before.jsonl", args.limit)
    print(json.dumps({"phase": "before", **before}), flush=True)
    policy = run_dir / "policy"
    train = [
        sys.executable, "-m", "agl_core.cli", "train", str(CONFIG),
        f"actor_rollout_ref.model.path={args.model}",
        f"trainer.default_local_dir={run_dir}",
        f"agentlightning.torch.merged_model_dir={policy}",
        *args.overrides,
    ]  # fmt: skip
    seconds, peak_rss = run(train)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "timing/step_s" in s]
    total_s = sum(s["timing/step_s"] for s in steps)
    tokens = [s["perf/total_num_tokens"] for s in steps if "perf/total_num_tokens" in s]
    tokens_s = round(sum(tokens) / total_s, 1) if len(tokens) == len(steps) else None
    training = {
        "steps": len(steps),
        "wall_s": round(seconds, 1),
        "step_s": round(total_s / len(steps), 1),
        "tokens_per_s": tokens_s,
        "peak_rss_mib": peak_rss,
        "reward_first": steps[0]["training/reward"],
        "reward_last": steps[-1]["training/reward"],
    }
    print(json.dumps({"phase": "train", **training}), flush=True)
    after = accuracy(trained_policy(run_dir, policy), run_dir / "test_after.jsonl", args.limit)
    print(json.dumps({"phase": "after", **after}), flush=True)
    summary = {"overrides": args.overrides, "before": before, "training": training, "after": after}
    (run_dir / "learning.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
        f"({after['accuracy'] - before['accuracy']:+.3f}) over {after['problems']} problems; "
        f"{training['steps']} steps in {training['wall_s']:.0f} s ({training['step_s']} s/step, "
        f"{training['tokens_per_s']} tokens/s, peak RSS {peak_rss} MiB)"
    )


if __name__ == "__main__":
    main()
