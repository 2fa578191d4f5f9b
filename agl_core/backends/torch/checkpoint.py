"""Checkpoints of the reference backend: everything an interrupted run needs to continue where it stopped.

A checkpoint is a folder ``global_step_{N}`` under the run directory (``trainer.default_local_dir``)
holding ``model/`` (the policy and tokenizer, loadable by any Hugging Face tool or inference server)
and ``trainer_state.pt`` (optimizer, lr scheduler, step, data position, every RNG state and, in
async mode, the rollout source's groups in flight and waiting samples, as plain data).
``latest_checkpointed_iteration.txt`` names the newest step, as verl's does. A checkpoint is written
to a temporary folder and renamed into place, so a run killed while saving leaves the previous one
intact.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.pt"


def rng_states() -> dict[str, Any]:
    """The process-wide RNG states (Python, numpy, torch CPU and CUDA)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(run_dir: str | Path, step: int, model: Any, tokenizer: Any, state: dict[str, Any]) -> Path:
    """Write ``global_step_{step}`` (``state``: optimizer, scheduler, data position, RNG...) and mark it newest."""
    run_dir = Path(run_dir)
    final = run_dir / f"global_step_{step}"
    partial = run_dir / f".global_step_{step}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial / "model")
    tokenizer.save_pretrained(partial / "model")
    torch.save({**state, "step": step}, partial / STATE_FILE)
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    (run_dir / LATEST_FILE).write_text(f"{step}\n")
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder under ``run_dir``, or ``None``."""
    marker = Path(run_dir) / LATEST_FILE
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{marker} should hold a step number, got {text!r}")
    path = Path(run_dir) / f"global_step_{int(text)}"
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{marker} names step {text}, but {path / STATE_FILE} is missing")
    return path


def load_checkpoint(path: str | Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load the checkpoint's weights into ``model`` and return its trainer state."""
    from safetensors.torch import load_file

    path = Path(path)
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((path / "model").glob("*.safetensors")):
        weights.update(load_file(shard))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {name for name in missing if getattr(model.config, "tie_word_embeddings", False) and "lm_head" in name}
    if set(missing) - tied or unexpected:
        raise ValueError(f"checkpoint {path} does not fit the model: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
    return torch.load(path / STATE_FILE, weights_only=False)
