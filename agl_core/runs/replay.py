"""``agl replay``: re-run one recorded step of a run, from the recording (:mod:`agl_core.files.recording`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agl_core.backends.untrained import NothingTrainedError, untrained_reason
from agl_core.errors import UsageError
from agl_core.fields import thaw
from agl_core.files.recording import read_recording
from agl_core.runs.run_config import registered_backend, resolve_config

__all__ = ["replay_step"]


def replay_step(
    run: str | Path, step: int, overrides: Sequence[str] = (), scratch: str | Path = ".", plugins: Iterable[Any] = ()
) -> dict[str, float]:
    """Re-run step ``step`` of the run recorded at ``run``: its recorded rollouts through the
    pipeline and the update of the backend the run used (``backend=`` in ``overrides`` picks another),
    from the run's checkpoint of the step before when its directory holds one, else the initial
    model; return the step's metrics.

    The config is the recording's (all of it on the recorded run's own backend, the keys the core
    schema knows on another), then ``overrides``; the dataset is the step's recorded samples, written
    to ``scratch``. A recording of another model or tokenizer than the config's is refused
    (:class:`~agl_core.files.recording.RecordingError`), as is a backend that cannot replay a step; a
    replayed step that trained nothing raises :class:`~agl_core.NothingTrainedError`."""
    from omegaconf import OmegaConf

    recording = read_recording(run)
    rollouts = recording.rollouts(step)
    recorded = OmegaConf.select(OmegaConf.create(recording.run_config()), "agentlightning.backend") or "torch"
    name = _backend(overrides) or recorded
    values = recording.run_config() if name == recorded else recording.core_config()
    scratch = Path(scratch)
    config_file, dataset = scratch / "config.yaml", scratch / "samples.jsonl"
    OmegaConf.save(OmegaConf.create(values), config_file)
    rows = [s if isinstance(s, Mapping) else {} for s in {r.group_id: thaw(r.input) for r in rollouts}.values()] or [{}]
    while len(rows) < int(recording.core_config().get("data", {}).get("train_batch_size") or 1):
        rows += rows  # a backend's data order needs a whole batch; replay reads none of it
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    replayed = [
        f"agentlightning.replay={recording.path}",
        "agentlightning.record_rollouts=false",
        "agentlightning.agl_base_url=null",
        "agentlightning.async_rollout.enabled=false",
        f"agentlightning.backend={name}",
        f"data.train_files={dataset}",
        "data.val_files=null",
        f"trainer.default_local_dir={recording.path.parent}",
    ]
    config, manager = resolve_config(str(config_file), [*replayed, *overrides], plugins)
    backend = registered_backend(manager, name).factory(config, manager)
    if not hasattr(backend, "replay_step"):
        raise UsageError(f"backend {name!r} cannot replay a recorded step (it has no replay_step)")
    tokenizer = getattr(backend, "tokenizer", None)
    if tokenizer is not None:  # a backend that loads its tokenizer elsewhere checks the recording there
        recording.check(config, tokenizer)
    metrics = backend.replay_step(rollouts, step)
    reason = untrained_reason(metrics)
    if reason is not None:
        raise NothingTrainedError(f"the replayed step {step} trained nothing: {reason}")
    return metrics


def _backend(overrides: Sequence[str]) -> str | None:
    """The backend ``overrides`` name (``backend=NAME`` or ``agentlightning.backend=NAME``), if any."""
    named = None
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+") in ("backend", "agentlightning.backend"):
            named = value
    return named
