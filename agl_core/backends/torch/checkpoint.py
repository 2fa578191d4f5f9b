"""Checkpoints of the reference backend: everything an interrupted run needs to continue where it stopped.

A checkpoint is a folder ``global_step_{N}`` under the run directory (``trainer.default_local_dir``)
holding ``model/`` (the policy and tokenizer, loadable by any Hugging Face tool or inference server)
or, in a LoRA run, ``adapter/`` (the PEFT adapter and tokenizer alone, loadable with PEFT or as
``actor_rollout_ref.model.lora_adapter_path``; the base weights never change) and
``trainer_state.pt`` (optimizer, lr scheduler, step, data position, every RNG state and, in async
mode, the rollout source's groups in flight and waiting samples, as plain data).
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

from agl_core.errors import FileFormatError
from agl_core.serving.weights import is_adapted

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.pt"
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"  # a LoRA run's checkpoints hold the adapter only


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
    weights = partial / (ADAPTER_DIR if is_adapted(model) else MODEL_DIR)
    model.save_pretrained(weights)
    tokenizer.save_pretrained(weights)
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
        raise FileFormatError(f"{marker} should hold a step number, got {text!r}")
    path = Path(run_dir) / f"global_step_{int(text)}"
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{marker} names step {text}, but {path / STATE_FILE} is missing")
    return path


def load_checkpoint(path: str | Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load the checkpoint's weights (a LoRA model's: its adapter) into ``model`` and return its trainer state."""
    from safetensors.torch import load_file

    path = Path(path)
    adapted, has_adapter = is_adapted(model), (path / ADAPTER_DIR).is_dir()
    if adapted != has_adapter:
        held, runs = ("a LoRA adapter", "without LoRA") if has_adapter else ("a full model", "with LoRA")
        raise FileFormatError(
            f"checkpoint {path} holds {held}, but this run trains {runs} (actor_rollout_ref.model.lora_rank)"
        )
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((path / (ADAPTER_DIR if adapted else MODEL_DIR)).glob("*.safetensors")):
        weights.update(load_file(shard))
    if adapted:
        _load_adapter(path, model, weights)
        return torch.load(path / STATE_FILE, weights_only=False)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {name for name in missing if getattr(model.config, "tie_word_embeddings", False) and "lm_head" in name}
    if set(missing) - tied or unexpected:
        raise FileFormatError(
            f"checkpoint {path} does not fit the model: missing {sorted(set(missing) - tied)}, unexpected {unexpected}"
        )
    return torch.load(path / STATE_FILE, weights_only=False)


def _load_adapter(path: Path, model: Any, weights: dict[str, torch.Tensor]) -> None:
    """Set a PEFT model's adapter weights from a checkpoint's, which must be exactly its own."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    expected = set(get_peft_model_state_dict(model))
    if set(weights) != expected:
        missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise FileFormatError(f"checkpoint {path} does not fit the adapter: missing {missing}, unexpected {unexpected}")
    set_peft_model_state_dict(model, weights)
