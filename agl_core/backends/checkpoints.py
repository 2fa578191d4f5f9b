"""The checkpoint folders of a run, whatever the backend: where they are, how they are written, and
what the step loop keeps in them beside the backend's own files.

A checkpoint is a folder ``global_step_{N}`` under the run directory (``trainer.default_local_dir``);
``latest_checkpointed_iteration.txt`` names the newest step (verl's layout). The step loop
(:class:`~agl_core.backends.loop_backend.LoopBackend`) writes one through :func:`write_checkpoint`:
the backend's files (weights, ...), then ``trainer_state.pt`` (the step, the data position, every
process-wide RNG state and the plain state the backend returned: its optimizer, ...), then, when the
rollout source carries rollouts into the next step (async), ``agl_rollout_source.pt``
(:func:`save_source_state`). It is written to a temporary folder and renamed into place, so a run
killed while saving leaves the previous checkpoint intact. A backend that writes its own checkpoints
(verl's) keeps its source's rollouts with the same two functions, in its own step folder.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from agl_core.config import ConfigError

if TYPE_CHECKING:
    from agl_core.rollouts.source import RolloutSource

__all__ = [
    "LATEST_FILE",
    "SOURCE_STATE_FILE",
    "STATE_FILE",
    "latest_checkpoint",
    "read_state",
    "restore_rng_states",
    "restore_source_state",
    "rng_states",
    "save_source_state",
    "write_checkpoint",
]

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.pt"
SOURCE_STATE_FILE = "agl_rollout_source.pt"
KEY = "trainer.default_local_dir"  # where the checkpoints are: errors about them name it


def rng_states() -> dict[str, Any]:
    """The process-wide RNG states (Python, numpy, torch CPU and CUDA)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: Mapping[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def write_checkpoint(
    run_dir: str | Path,
    step: int,
    write: Callable[[Path], Mapping[str, Any]],
    state: Mapping[str, Any],
    source: RolloutSource | None = None,
) -> Path:
    """Write ``global_step_{step}`` and mark it newest: ``write(folder)`` puts the backend's files in
    the folder and returns its plain state, kept with ``state`` (the loop's) in ``trainer_state.pt``;
    ``source``'s carried rollouts go beside them."""
    run_dir = Path(run_dir)
    final = run_dir / f"global_step_{step}"
    partial = run_dir / f".global_step_{step}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    own = write(partial)
    torch.save({**own, **state, "step": step}, partial / STATE_FILE)
    if source is not None:
        save_source_state(source, partial)
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
        raise ConfigError(KEY, f"{marker} should hold a step number, got {text!r}")
    path = Path(run_dir) / f"global_step_{int(text)}"
    if not (path / STATE_FILE).is_file():
        raise ConfigError(KEY, f"{marker} names step {text}, but {path / STATE_FILE} is missing")
    return path


def read_state(folder: str | Path) -> dict[str, Any]:
    """The ``trainer_state.pt`` of a checkpoint folder: the loop's state and the backend's."""
    return torch.load(Path(folder) / STATE_FILE, weights_only=False)


def save_source_state(source: RolloutSource, folder: str | Path) -> None:
    """Keep what ``source`` carries into the next step (async: its groups in flight and waiting
    samples) in ``folder/agl_rollout_source.pt``; nothing when it carries nothing."""
    carried = source.state()
    if carried is not None:
        torch.save(carried, Path(folder) / SOURCE_STATE_FILE)


def restore_source_state(source: RolloutSource, folder: str | Path) -> int:
    """Give ``source`` what the run carried at the checkpoint in ``folder`` (before the first step);
    how many samples that carries into the next step (0 when the checkpoint holds none)."""
    path = Path(folder) / SOURCE_STATE_FILE
    if not path.is_file():
        return 0
    return source.restore(torch.load(path, weights_only=False))
