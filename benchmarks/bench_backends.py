"""The corridor task on the torch backend and on verl in each V1 trainer mode, in one run: reward by
step and step time split, side by side.

The reference (torch) backend trains with its embedded rollouts (``examples/corridor/config.yaml``
as shipped); verl trains the same config, policy and seed through the real gateway and controller
on 127.0.0.1 in verl's CPU mode (``examples/corridor/run_verl.sh`` with
``agl_backend_verl.cpu.CPU_KEYS``: verl's workers on 2 gloo ranks, the CPU replica), once per
``trainer.v1.trainer_mode`` (``sync``, ``colocate_async``, ``separate_async``; the last adds the keys
of :func:`agl_backend_verl.cpu.mode_keys`: its own replica on its own CPU ranks). It prints the
training reward of every step for each, the first step whose training reward reaches 0.9, then the
mean seconds per step of generation (``timing/gen_s``: waiting for the step's groups), log-probs
(``timing/log_prob_s``), the update (``timing/actor_update_s``), the weight push
(``timing/update_weights_s``; the torch backend copies its weights inside the step), the rest of the
step (idle: checkpoints, hooks, reporting) and the whole step.

Needs the gateway venv (``scripts/gateway_venv.sh``). A long run: the corridor reaches a reward of
about 0.9 within 50 steps; ``--steps`` sets every run's length, ``--modes`` which verl modes run.

    python benchmarks/bench_backends.py --steps 60
    python benchmarks/bench_backends.py --steps 4 --modes sync --work-dir /tmp/bench   # a quick look
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

from agl_backend_verl.config import V1_MODES  # noqa: E402
from agl_backend_verl.cpu import CPU_KEYS, mode_keys  # noqa: E402
from examples.corridor.build_policy import build  # noqa: E402
from tests.helpers.verl_e2e import RUN_VERL, Stack  # noqa: E402

CONFIG = REPO_ROOT / "examples" / "corridor" / "config.yaml"
PHASES = ("timing/gen_s", "timing/log_prob_s", "timing/actor_update_s", "timing/update_weights_s")
# Every run: the same steps, no validation or checkpoints in the timed steps.
COMMON = (
    "trainer.save_freq=-1",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "trainer.resume_mode=disable",
)
TARGET = 0.9
# The corridor's batch is one mini-batch (ppo_mini_batch_size = train_batch_size = 4): separate_async
# trains it in one update per step, as the other modes do.
RUN_KEYS = {"separate_async": ("trainer.v1.separate_async.parameter_sync_step=1",)}


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAY_AUTH_MODE": "disabled", "AGL_DISABLE_PLUGIN_AUTOLOAD": "1"}


def run(command: list[str], environment: dict[str, str], log: Path) -> None:
    with log.open("wb") as out:
        code = subprocess.run(
            command, cwd=REPO_ROOT, env=environment, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        ).returncode
    if code:
        sys.exit(f"{command[:4]} exited with {code}; see {log}")


def torch_run(policy: Path, work: Path, steps: int) -> list[dict]:
    run_dir = work / "torch"
    command = [
        sys.executable, "-m", "agl_core.cli", "train", str(CONFIG), f"actor_rollout_ref.model.path={policy}",
        f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={run_dir}", *COMMON,
    ]  # fmt: skip
    run(command, env(), work / "torch.log")
    return metrics(run_dir)


def verl_run(policy: Path, work: Path, steps: int, mode: str) -> list[dict]:
    run_dir, stack_dir = work / mode, work / f"{mode}-stack"
    stack_dir.mkdir(parents=True, exist_ok=True)
    with Stack(policy, stack_dir) as stack:
        environment = {
            **env(),
            "MODEL_PATH": str(policy),
            "AGL_BASE_URL": stack.gateway.url,
            "AGL_KEY": stack.gateway.key,
            "STEPS": str(steps),
            "RUN_DIR": str(run_dir),
            "PYTHON": sys.executable,
        }
        keys = [*CPU_KEYS, *mode_keys(mode), *RUN_KEYS.get(mode, ()), f"trainer.v1.trainer_mode={mode}", *COMMON]
        run(["bash", str(RUN_VERL), *keys], environment, work / f"{mode}.log")
    return metrics(run_dir)


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row for row in rows if row["step"] >= 1]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def phase(rows: list[dict], key: str) -> float:
    return mean([row[key] for row in rows if isinstance(row.get(key), (int, float))])


def idle(rows: list[dict]) -> float:
    """The step's seconds outside the timed phases."""
    return mean(
        [row["timing/step_s"] - sum(row.get(k) or 0.0 for k in PHASES) for row in rows if "timing/step_s" in row]
    )


def reward(rows: list[dict], step: int) -> float:
    value = next((r.get("training/reward") for r in rows if r["step"] == step), None)
    return math.nan if value is None else float(value)


def first_at_target(rows: list[dict]) -> str:
    step = next((r["step"] for r in rows if (r.get("training/reward") or 0.0) >= TARGET), None)
    return "never" if step is None else str(step)


def cell(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="training steps of every run (default: 60)")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=V1_MODES,
        default=list(V1_MODES),
        help="the verl trainer modes to run beside the torch backend (default: all three)",
    )
    parser.add_argument(
        "--work-dir", type=Path, help="where the runs' folders, logs and metrics go (default: a new temporary folder)"
    )
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="agl-bench-backends-"))
    work.mkdir(parents=True, exist_ok=True)
    policy = build(work / "policy", seed=0)
    columns = {"torch": torch_run(policy, work, args.steps)}
    for mode in args.modes:
        columns[f"verl {mode}"] = verl_run(policy, work, args.steps, mode)
    names = list(columns)
    width = max(len(name) for name in names) + 2
    print(f"corridor, {args.steps} steps (logs and metrics in {work})\n")
    print("training reward by step")
    print(f"{'step':>4}" + "".join(f"{name:>{width}}" for name in names))
    for step in range(1, args.steps + 1):
        print(f"{step:>4}" + "".join(f"{cell(reward(rows, step)):>{width}}" for rows in columns.values()))
    print(
        f"\n{'first step >= ' + str(TARGET):<26}" + "".join(f"{first_at_target(r):>{width}}" for r in columns.values())
    )
    print(f"\n{'mean seconds per step':<26}" + "".join(f"{name:>{width}}" for name in names))
    for key in PHASES:
        print(f"{key:<26}" + "".join(f"{cell(phase(rows, key)):>{width}}" for rows in columns.values()))
    print(f"{'idle (the rest)':<26}" + "".join(f"{cell(idle(rows)):>{width}}" for rows in columns.values()))
    print(
        f"{'timing/step_s':<26}"
        + "".join(f"{cell(phase(rows, 'timing/step_s')):>{width}}" for rows in columns.values())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
