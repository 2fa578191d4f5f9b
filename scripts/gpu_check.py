"""Two verl training steps of the corridor task on one GPU, through the whole production stack.

Builds the corridor's tiny policy (2-layer Llama, head size 32: vLLM and FSDP load it), starts the
real gateway (``agl-server``) and the real controller (``agl-controller runner_type=local``, one
corridor agent process per rollout) on 127.0.0.1, then runs ``examples/corridor/run_verl.sh``
(``agl train examples/corridor/config.yaml`` with backend ``verl`` and the settings one GPU needs:
FSDP actor, one vLLM replica with tensor parallel 1, a small share of GPU memory) for a smaller
batch and two steps. It checks that two steps finished with every rollout traced and finite
metrics, and stops every process it started, by PID, whatever happens.

Not yet run on a GPU (none was available where it was written): its command is checked on CPU by
``tests/verl/test_gpu_check.py`` (every key exists with verl's type; verl's ``validate_config`` and
worker config dataclasses accept the config).

Needs: an NVIDIA GPU, ``pip install -e '.[vllm]'`` (verl 0.9.1 + vLLM), and Python 3.12 for the
gateway venv (``scripts/gateway_venv.sh`` builds ``.venvs/gateway`` on first use; set
``AGL_PYTHON312`` if 3.12 is not found). Usage, from the repository root::

    python scripts/gpu_check.py [--work-dir DIR] [--timeout SECONDS]

Exit status 0: the check passed; 1: it failed (the logs are printed); 2: no GPU or no vLLM here.
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

from agl_core.serving.processes import stop_process_group  # noqa: E402
from examples.corridor.build_policy import build  # noqa: E402
from tests.helpers.gateway_server import Controller, GatewayServer  # noqa: E402

RUN_VERL = REPO_ROOT / "examples" / "corridor" / "run_verl.sh"
STEPS = 2
BATCH, N = 2, 4  # groups per step, rollouts per group
CONTROLLER_POOL = 8  # agents running at once: a whole step's rollouts
# Finite in every step that trained: the rollouts' reward, and the update verl's actor made.
FINITE_METRICS = ("training/reward", "actor/pg_loss", "actor/grad_norm")


def train_command(gateway_url: str, key: str, policy_dir: Path, run_dir: Path) -> tuple[list[str], dict[str, str]]:
    """``examples/corridor/run_verl.sh`` (the one-GPU verl settings) with this check's smaller run:
    the command and its environment."""
    env = {
        **os.environ,
        "MODEL_PATH": str(policy_dir),
        "AGL_BASE_URL": gateway_url,
        "AGL_KEY": key,
        "N_GPUS": "1",
        "STEPS": str(STEPS),
        "RUN_DIR": str(run_dir),
        "PYTHON": sys.executable,
    }
    overrides = [
        f"data.train_batch_size={BATCH}",
        f"actor_rollout_ref.rollout.n={N}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "ray_kwargs.ray_init.num_cpus=8",
    ]
    return ["bash", str(RUN_VERL), *overrides], env


def preflight() -> str | None:
    """Why this machine cannot run the check, or ``None``."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (verl trains on GPUs only)"
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return f"vLLM is not importable ({exc}); install it with: pip install -e '.[vllm]'"
    return None


def check_metrics(run_dir: Path) -> list[str]:
    """What is wrong with the run's ``metrics.jsonl`` (empty when two good steps are there)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return [f"{path} was not written"]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    problems = []
    if [row.get("step") for row in rows] != list(range(1, STEPS + 1)):
        problems.append(f"steps logged: {[row.get('step') for row in rows]}, expected 1..{STEPS}")
    for row in rows:
        if row.get("training/n_rollouts") != BATCH * N or row.get("training/n_rollouts_w_trace") != BATCH * N:
            problems.append(f"step {row.get('step')}: rollouts {row.get('training/n_rollouts')}, with trace {row.get('training/n_rollouts_w_trace')}, expected {BATCH * N}")
        for key in FINITE_METRICS:
            value = row.get(key)  # agl train writes a non-finite number as null
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                problems.append(f"step {row.get('step')}: {key} = {value!r}, expected a finite number")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, help="where the policy, logs and run go (default: a new temp dir)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="longest wait for agl train, in seconds")
    args = parser.parse_args()
    missing = preflight()
    if missing:
        print(f"gpu_check: cannot run here: {missing}", file=sys.stderr)
        return 2
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="agl-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    policy_dir = build(work / "policy", seed=0)
    run_dir = work / "run"
    # The gateway's model name must be the trainer's model path (verl's vLLM serves it under that name).
    gateway = GatewayServer(key="gpu-check-key", model_name=str(policy_dir))
    controller = Controller(gateway, CONTROLLER_POOL, work / "controller.log")
    train_log = work / "train.log"
    trainer = None
    try:
        gateway.start()
        controller.start()
        command, env = train_command(gateway.url, gateway.key, policy_dir, run_dir)
        print(f"gpu_check: {' '.join(command)} (policy {policy_dir})\ngpu_check: logs in {work}", flush=True)
        with train_log.open("wb") as log:
            # its own process group, so that Ray's processes stop with it
            trainer = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            code = trainer.wait(timeout=args.timeout)
        problems = [f"agl train exited with {code}"] if code else []
        problems += check_metrics(run_dir)
    except subprocess.TimeoutExpired:
        problems = [f"agl train did not finish within {args.timeout:g}s"]
    finally:
        if trainer is not None:
            stop_process_group(trainer, grace=30)
        controller.stop()
        gateway_log = gateway.log_text()
        gateway.stop()
    if problems:
        print("gpu_check: FAILED\n  " + "\n  ".join(problems), file=sys.stderr)
        for name, text in (
            ("agl train", train_log.read_text(errors="replace")[-6000:] if train_log.is_file() else ""),
            ("controller", controller.log_path.read_text(errors="replace")[-3000:] if controller.log_path.is_file() else ""),
            ("gateway", gateway_log),
        ):
            print(f"--- {name} log (tail):\n{text}", file=sys.stderr)
        return 1
    print(f"gpu_check: OK: {STEPS} verl steps on one GPU through the gateway and controller; metrics in {run_dir / 'metrics.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
