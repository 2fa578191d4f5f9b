"""Helpers for tests that run a real vLLM server: the venv, a writable model copy, and log-probs
computed both ways (served by vLLM, and by a transformers fp32 forward pass)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import httpx
import torch

from agl_core.serving.vllm_engine import CHECKOUT_VLLM_PYTHON, VLLM_PYTHON_ENV, VllmEngine
from tests.helpers.paths import REPO_ROOT

VENV_SCRIPT = REPO_ROOT / "scripts" / "vllm_venv.sh"


def vllm_python() -> Path:
    """The vLLM venv's python (``$AGL_VLLM_PYTHON``, else the venv ``scripts/vllm_venv.sh`` builds
    in this checkout), building that venv first if it is missing."""
    configured = os.environ.get(VLLM_PYTHON_ENV)
    path = Path(configured) if configured else REPO_ROOT / CHECKOUT_VLLM_PYTHON
    if not path.exists():
        subprocess.run(["bash", str(VENV_SCRIPT)], check=True)
    if not path.exists():
        raise FileNotFoundError(f"{path} missing after {VENV_SCRIPT}")
    return path


def writable_model_copy(source: Path, dest: Path) -> Path:
    """A copy of the (read-only) fixture model that tests may load, perturb and save."""
    shutil.copytree(source, dest)
    for path in [dest, *dest.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dest


def complete(engine: VllmEngine, prompt_ids: list[int], max_tokens: int, seed: int) -> tuple[list[int], list[float]]:
    """Sample from the served model for token-id prompt; return its token ids and their log-probs."""
    response = httpx.post(
        f"{engine.base_url}/completions",
        json={
            "model": engine.model_name,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": seed,
            "logprobs": 0,
            "return_token_ids": True,
        },
        timeout=120.0,
    )
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@torch.no_grad()
def forward_log_probs(model: torch.nn.Module, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    """Log-prob of each response token given everything before it, from one fp32 forward pass."""
    ids = torch.tensor([prompt_ids + response_ids])
    logits = model(input_ids=ids).logits[0].float()
    log_probs = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return log_probs.gather(-1, torch.tensor(response_ids)[:, None]).squeeze(-1).tolist()


def prefix_cache_hits(engine: VllmEngine) -> float:
    """vLLM's ``prefix_cache_hits_total``: prompt tokens it took from the prefix cache so far."""
    text = httpx.get(f"{engine.server_url}/metrics", timeout=10.0).text
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{engine.server_url}/metrics has no vllm:prefix_cache_hits_total")
