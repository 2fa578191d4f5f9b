"""The corridor task on the torch backend, the trl backend and verl in each V1 trainer mode, in one
run, every column on the same rollout path: reward by step and step time split, side by side.

Every backend trains ``examples/corridor/config.yaml`` with the same policy and seed, its agents on
one path (``--rollouts``): ``embedded`` (the default: the config's agents in threads of the trainer,
calling its served policy) or ``gateway`` (the real gateway and ``agl-controller runner_type=local``
on 127.0.0.1, one agent process per rollout, at most 4 at once; one gateway and controller per
column). torch and trl (one process) run ``agl train`` as shipped; verl runs
``examples/corridor/run_verl.sh`` in verl's CPU mode (``agl_backend_verl.cpu.CPU_KEYS``: verl's
workers on 2 gloo ranks, the CPU replica), once per ``trainer.v1.trainer_mode`` (``sync``,
``colocate_async``, ``separate_async``; the last adds the keys of
:func:`agl_backend_verl.cpu.mode_keys`: its own replica on its own CPU ranks). It prints the training
reward of every step for each, the first step whose training reward reaches 0.9, then the mean
seconds per step of generation (``timing/gen_s``: waiting for the step's groups), log-probs
(``timing/log_prob_s``), the update (``timing/actor_update_s``), the weight push
(``timing/update_weights_s``; the torch backend copies its weights inside the step), the rest of the
step (idle: checkpoints, hooks, reporting) and the whole step.

``--rollouts gateway`` needs the gateway venv (``scripts/gateway_venv.sh``). A long run: the corridor
reaches a reward of about 0.9 within 50 steps; ``--steps`` sets every run's length, ``--modes`` which
verl modes run (none: ``--modes``).

    python benchmarks/bench_backends.py --steps 60
    python benchmarks/bench_backends.py --steps 4 --modes sync --rollouts gateway --work-dir /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from contextlib import AbstractContextManager, nullcontext
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


def rollout_path(rollouts: str, policy: Path, folder: Path) -> AbstractContextManager[Stack | None]:
    """The gateway and controller of one column (``gateway``), or nothing (``embedded``)."""
    if rollouts == "embedded":
        return nullcontext()
    folder.mkdir(parents=True, exist_ok=True)
    return Stack(policy, folder)


def gateway_keys(stack: Stack | None) -> list[str]:
    """The keys that send a run's agents through ``stack``; none for the embedded agents."""
    if stack is None:
        return ["agentlightning.agl_base_url=null", "agentlightning.agl_key=''"]
    return [f"agentlightning.agl_base_url={stack.gateway.url}", f"agentlightning.agl_key={stack.gateway.key}"]


def agl_run(backend: str, policy: Path, work: Path, steps: int, rollouts: str) -> list[dict]:
    """``agl train`` of the shipped config on ``backend`` (torch, trl)."""
    run_dir = work / backend
    with rollout_path(rollouts, policy, work / f"{backend}-stack") as stack:
        command = [
            sys.executable, "-m", "agl_core.cli", "train", str(CONFIG), f"agentlightning.backend={backend}",
            f"actor_rollout_ref.model.path={policy}", f"trainer.total_training_steps={steps}",
            f"trainer.default_local_dir={run_dir}", *gateway_keys(stack), *COMMON,
        ]  # fmt: skip
        run(command, env(), work / f"{backend}.log")
    return metrics(run_dir)


def verl_run(policy: Path, work: Path, steps: int, mode: str, rollouts: str) -> list[dict]:
    """``run_verl.sh`` in verl's CPU mode and trainer mode ``mode`` (its later keys win: the
    embedded agents' ``agl_base_url: null`` over the script's)."""
    run_dir = work / mode
    with rollout_path(rollouts, policy, work / f"{mode}-stack") as stack:
        environment = {
            **env(),
            "MODEL_PATH": str(policy),
            "AGL_BASE_URL": stack.gateway.url if stack else "http://127.0.0.1:9",  # replaced by the keys
            "AGL_KEY": stack.gateway.key if stack else "unused",
            "STEPS": str(steps),
            "RUN_DIR": str(run_dir),
            "PYTHON": sys.executable,
        }
        keys = [*CPU_KEYS, *mode_keys(mode), *RUN_KEYS.get(mode, ()), f"trainer.v1.trainer_mode={mode}"]
        run(["bash", str(RUN_VERL), *keys, *gateway_keys(stack), *COMMON], environment, work / f"{mode}.log")
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
        nargs="*",
        choices=V1_MODES,
        default=list(V1_MODES),
        help="the verl trainer modes to run beside the torch and trl backends (default: all three)",
    )
    parser.add_argument(
        "--rollouts",
        choices=("embedded", "gateway"),
        default="embedded",
        help="every column's rollout path: agents in the trainer, or the real gateway and controller",
    )
    parser.add_argument(
        "--work-dir", type=Path, help="where the runs' folders, logs and metrics go (default: a new temporary folder)"
    )
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="agl-bench-backends-"))
    work.mkdir(parents=True, exist_ok=True)
    policy = build(work / "policy", seed=0)
    columns = {backend: agl_run(backend, policy, work, args.steps, args.rollouts) for backend in ("torch", "trl")}
    for mode in args.modes:
        columns[f"verl {mode}"] = verl_run(policy, work, args.steps, mode, args.rollouts)
    names = list(columns)
    width = max(len(name) for name in names) + 2
    print(f"corridor, {args.steps} steps, {args.rollouts} agents (logs and metrics in {work})\n")
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
