"""``agl replay``: re-run one recorded step of a run, from the recording (:mod:`agl_core.recording`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agl_core.fields import thaw
from agl_core.recording import read_recording
from agl_core.run_config import registered_backend, resolve_config

__all__ = ["replay_step"]


def replay_step(
    run: str | Path, step: int, overrides: Sequence[str] = (), scratch: str | Path = ".", plugins: Iterable[Any] = ()
) -> dict[str, float]:
    """Re-run step ``step`` of the run recorded at ``run``: its recorded rollouts through the
    pipeline and the torch backend's update, from the run's checkpoint of the step before when its
    directory holds one, else the initial model; return the step's metrics.

    The config is the recording's (the keys the core schema knows), then ``overrides``; the dataset is
    the step's recorded samples, written to ``scratch``. A recording of another model or tokenizer
    than the config's is refused (:class:`~agl_core.recording.RecordingError`)."""
    from omegaconf import OmegaConf

    recording = read_recording(run)
    rollouts = recording.rollouts(step)
    scratch = Path(scratch)
    config_file, dataset = scratch / "config.yaml", scratch / "samples.jsonl"
    OmegaConf.save(OmegaConf.create(recording.core_config()), config_file)
    rows = [s if isinstance(s, Mapping) else {} for s in {r.group_id: thaw(r.input) for r in rollouts}.values()] or [{}]
    while len(rows) < int(recording.core_config().get("data", {}).get("train_batch_size") or 1):
        rows += rows  # the torch backend's data order needs a whole batch; replay reads none of it
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    replayed = [
        f"agentlightning.replay={recording.path}",
        "agentlightning.record_rollouts=false",
        "agentlightning.agl_base_url=null",
        "agentlightning.async_rollout.enabled=false",
        "agentlightning.backend=torch",
        f"data.train_files={dataset}",
        "data.val_files=null",
        f"trainer.default_local_dir={recording.path.parent}",
    ]
    config, manager = resolve_config(str(config_file), [*replayed, *overrides], plugins)
    backend = registered_backend(manager, "torch").factory(config, manager)
    recording.check(config, backend.tokenizer)
    return backend.replay_step(rollouts, step)
