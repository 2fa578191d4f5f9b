"""The corridor task on both backends in one run: reward by step and step time split, side by side.

The reference (torch) backend trains with its embedded rollouts (``examples/corridor/config.yaml``
as shipped); the verl backend trains the same config, policy and seed through the real gateway and
controller on 127.0.0.1 in verl's CPU mode (``examples/corridor/run_verl.sh`` with
``agl_backend_verl.cpu.CPU_KEYS``: verl's workers on 2 gloo ranks, the CPU replica). It prints the
training reward of every step for both, then the mean seconds per step of generation
(``timing/gen_s``), log-probs (``timing/log_prob_s``), the update (``timing/actor_update_s``), the
weight push (``timing/update_weights_s``, verl only: the torch backend copies weights in its step
without timing it) and the whole step, with the verl/torch ratio.

Needs the gateway venv (``scripts/gateway_venv.sh``). A long run: the corridor reaches a reward of
about 0.9 within 100 steps on the torch backend; ``--steps`` sets both runs' length.

    python benchmarks/bench_backends.py --steps 100
    python benchmarks/bench_backends.py --steps 4 --work-dir /tmp/bench   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from agl_backend_verl.cpu import CPU_KEYS  # noqa: E402
from examples.corridor.build_policy import build  # noqa: E402
from tests.helpers.verl_e2e import RUN_VERL, Stack  # noqa: E402

CONFIG = REPO_ROOT / "examples" / "corridor" / "config.yaml"
PHASES = ("timing/gen_s", "timing/log_prob_s", "timing/actor_update_s", "timing/update_weights_s", "timing/step_s")
# Both runs: the same steps, no validation or checkpoints in the timed steps.
COMMON = (
    "trainer.save_freq=-1",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "trainer.resume_mode=disable",
)


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAY_AUTH_MODE": "disabled", "AGL_DISABLE_PLUGIN_AUTOLOAD": "1"}


def run(command: list[str], environment: dict[str, str], log: Path) -> None:
    with log.open("wb") as out:
        code = subprocess.run(
            command, cwd=REPO_ROOT, env=environment, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        ).returncode
    if code:
        sys.exit(f"{command[:4]} exited with {code}; see {log}")


def torch_run(policy: Path, run_dir: Path, steps: int) -> list[dict]:
    command = [
        sys.executable, "-m", "agl_core.cli", "train", str(CONFIG), f"actor_rollout_ref.model.path={policy}",
        f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={run_dir}", *COMMON,
    ]  # fmt: skip
    run(command, env(), run_dir.parent / "torch.log")
    return metrics(run_dir)


def verl_run(policy: Path, work: Path, steps: int) -> list[dict]:
    run_dir = work / "verl"
    with Stack(policy, work) as stack:
        environment = {
            **env(),
            "MODEL_PATH": str(policy),
            "AGL_BASE_URL": stack.gateway.url,
            "AGL_KEY": stack.gateway.key,
            "STEPS": str(steps),
            "RUN_DIR": str(run_dir),
            "PYTHON": sys.executable,
        }
        run(["bash", str(RUN_VERL), *CPU_KEYS, *COMMON], environment, work / "verl.log")
    return metrics(run_dir)


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row for row in rows if row["step"] >= 1]


def mean(rows: list[dict], key: str) -> float:
    values = [row[key] for row in rows if isinstance(row.get(key), (int, float))]
    return sum(values) / len(values) if values else math.nan


def cell(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--work-dir", type=Path)
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="agl-bench-backends-"))
    work.mkdir(parents=True, exist_ok=True)
    policy = build(work / "policy", seed=0)
    torch_rows = torch_run(policy, work / "torch", args.steps)
    verl_rows = verl_run(policy, work, args.steps)
    print(f"corridor, {args.steps} steps (logs and metrics in {work})\n")
    print(f"{'step':>4}  {'torch reward':>12}  {'verl reward':>11}")
    for step in range(1, args.steps + 1):
        t = next((r.get("training/reward") for r in torch_rows if r["step"] == step), None)
        v = next((r.get("training/reward") for r in verl_rows if r["step"] == step), None)
        print(f"{step:>4}  {cell(t if t is not None else math.nan):>12}  {cell(v if v is not None else math.nan):>11}")
    print(f"\n{'mean seconds per step':<24}  {'torch':>8}  {'verl':>8}  {'verl/torch':>10}")
    for key in PHASES:
        t, v = mean(torch_rows, key), mean(verl_rows, key)
        ratio = v / t if t and not math.isnan(t) and not math.isnan(v) else math.nan
        print(f"{key:<24}  {cell(t):>8}  {cell(v):>8}  {cell(ratio):>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
