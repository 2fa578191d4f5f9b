"""The verl backend's end-to-end check on one GPU: the CPU check (``tests/verl/test_two_nodes_e2e.py``'s
scenario) on one node with the GPU keys and vLLM.

Builds the corridor's tiny policy (2-layer Llama, head size 32: vLLM and FSDP load it), starts the
real gateway (``agl-server``) and the real controller (``agl-controller runner_type=local``, one
corridor agent process per rollout) on 127.0.0.1, then runs ``tests.helpers.verl_e2e.scenario`` through
``examples/corridor/run_verl.sh`` (FSDP actor, one vLLM replica with tensor parallel 1, a small
share of GPU memory): 2 sync steps, async steps 3 and 4 resumed from verl's checkpoint, a kill after
step 3 and a resume. It checks that every rollout was traced, rows trained, reward, loss and grad
norm are finite, every model call ran on a registered weight version, the groups in flight survived
the kill and the gateway key is in no output; it stops every process it started, by PID.

Not yet run on a GPU (none was available where it was written); the same scenario runs in CI on CPU.

Needs: an NVIDIA GPU, ``pip install -e '.[vllm]'`` (verl 0.9.1 + vLLM), and Python 3.12 for the
gateway venv (``scripts/gateway_venv.sh`` builds ``.venvs/gateway`` on first use; set
``AGL_PYTHON312`` if 3.12 is not found). Usage, from the repository root::

    python scripts/gpu_check.py [--work-dir DIR] [--timeout SECONDS]

Exit status 0: the check passed; 1: it failed (the logs are printed); 2: no GPU or no vLLM here.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from examples.corridor.build_policy import build  # noqa: E402
from tests.helpers.verl_e2e import Stack, scenario  # noqa: E402

# What run_verl.sh does not set for this check: the GPU keys are its defaults (vLLM, one GPU).
GPU_KEYS = ("ray_kwargs.ray_init.num_cpus=8",)


def preflight() -> str | None:
    """Why this machine cannot run the check, or ``None``."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (run tests/verl/test_two_nodes_e2e.py for the CPU check)"
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return f"vLLM is not importable ({exc}); install it with: pip install -e '.[vllm]'"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, help="where the policy, logs and run go (default: a new temp dir)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="longest wait for one agl train, in seconds")
    args = parser.parse_args()
    missing = preflight()
    if missing:
        print(f"gpu_check: cannot run here: {missing}", file=sys.stderr)
        return 2
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="agl-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    policy = build(work / "policy", seed=0)
    print(f"gpu_check: logs in {work}", flush=True)
    try:
        with Stack(policy, work) as stack:
            problems, lines = scenario(stack, GPU_KEYS, n_gpus=1, timeout=args.timeout)
    except RuntimeError as exc:  # a run that failed or hung: its log tail is in the message
        problems, lines = [str(exc)], []
    print("\n".join(lines))
    if problems:
        print("gpu_check: FAILED\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(
        "gpu_check: OK: sync, async, kill and resume on one GPU through the gateway and controller; "
        f"run in {work / 'run'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
