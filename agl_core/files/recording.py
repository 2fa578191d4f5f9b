"""The rollout recording: each training step's completed rollouts, as the step pipeline received them.

With ``agentlightning.record_rollouts`` the pipeline appends every step it prepares to
``rollouts.jsonl`` in the run directory (:class:`RecordingWriter`), on every backend and rollout
source; ``agentlightning.replay`` feeds such a file back to a run (:mod:`agl_core.rollouts.replay`)
and ``agl replay RUN_DIR --step N`` re-runs one step. The format (docs/replay.md) is JSON lines:

- line 1, the header: ``{"format": "agl-rollouts", "version": 1, "model": {...}, "tokenizer":
  {...}, "config": {...}, "created_at": ...}``: the model (path, served name, the architecture
  fields of its ``config.json``), the tokenizer's fingerprint (vocabulary size and a SHA-256 of its
  vocabulary and special tokens) and the run's resolved config with secrets hidden;
- then one line per step: ``{"step": N, "rollouts": [CompletedRollout.to_dict(), ...]}``.

The file is only ever appended to. A resumed run checks that the header matches its own model and
tokenizer and appends; a step it redoes (killed between its report and its checkpoint) is written
again, and the reader keeps the last line of each step. Secret values (``SECRET_KEYS``) are never
written: the config's are hidden, and any string of a rollout that contains one has it replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from omegaconf import OmegaConf

from agl_core.config import REDACTED, SECRET_KEYS, ConfigError, default_config, redacted
from agl_core.data import CompletedRollout
from agl_core.errors import AglError
from agl_core.files.jsonl import read_json_objects

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "RECORDING_FILE",
    "Recording",
    "RecordingError",
    "RecordingWriter",
    "model_fingerprint",
    "read_recording",
    "recording_file",
    "tokenizer_fingerprint",
]

FORMAT = "agl-rollouts"
FORMAT_VERSION = 1
RECORDING_FILE = "rollouts.jsonl"
BYTES_METRIC = "training/record/bytes"
REDACTED_METRIC = "training/record/n_redacted_strings"
# The config.json fields that decide whether recorded token ids mean the same to another model.
MODEL_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


class RecordingError(AglError, ValueError):
    """A recording cannot be read or does not fit the run; the message names the file (and step)."""

    __module__ = "agl_core"

    hint = "agl replay and agentlightning.replay read what agentlightning.record_rollouts writes (docs/replay.md)"


def recording_file(path: str | os.PathLike[str]) -> Path:
    """The recording at ``path``: the file itself, or ``rollouts.jsonl`` of a run directory."""
    path = Path(os.path.expanduser(os.fspath(path)))
    return path / RECORDING_FILE if path.is_dir() else path


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """``{"vocab_size", "sha256"}``: the size of the tokenizer and a hash of its vocabulary (token →
    id) and special tokens, so two tokenizers that map ids to different text never match."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", ()))
    digest = hashlib.sha256(json.dumps([vocab, special], ensure_ascii=False).encode()).hexdigest()
    return {"vocab_size": len(tokenizer), "sha256": digest}


def model_fingerprint(config: Any) -> dict[str, Any]:
    """The run's model: ``path`` (``actor_rollout_ref.model.path``) and the architecture fields of its
    ``config.json`` that exist (``MODEL_FIELDS``)."""
    path = str(config.actor_rollout_ref.model.path)
    try:
        fields = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        fields = {}
    return {"path": path, **{k: fields[k] for k in MODEL_FIELDS if k in fields}}


def _header(config: Any, tokenizer: Any) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model": model_fingerprint(config),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "config": OmegaConf.to_container(redacted(config), resolve=True),
        "created_at": time.time(),
    }


def mismatch(recorded: Mapping[str, Any], header: Mapping[str, Any]) -> str | None:
    """What differs between a recording's header and a run's (``header``): the model's architecture
    fields or the tokenizer; ``None`` when they match (model paths may differ)."""
    for part in ("model", "tokenizer"):
        for key, value in header[part].items():
            if key != "path" and recorded.get(part, {}).get(key) != value:
                return f"{part} {key} is {recorded.get(part, {}).get(key)!r} in the recording, {value!r} in this run"
    return None


def _secret_values(config: Any) -> list[str]:
    return [str(v) for key in SECRET_KEYS if (v := OmegaConf.select(config, key)) and str(v) != REDACTED]


def _scrub(value: Any, secrets: Sequence[str], counter: list[int]) -> Any:
    """``value`` (JSON-like) with every secret inside its strings (and keys) replaced by ``***``."""
    if isinstance(value, str):
        if any(s in value for s in secrets):
            counter[0] += 1
            for s in secrets:
                value = value.replace(s, REDACTED)
        return value
    if isinstance(value, Mapping):
        return {_scrub(k, secrets, counter): _scrub(v, secrets, counter) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_scrub(v, secrets, counter) for v in value]
    return value


class RecordingWriter:
    """Appends each step's rollouts to ``trainer.default_local_dir``/``rollouts.jsonl``.

    Created by ``agl_core.stages.pipeline.StepPipeline`` when ``agentlightning.record_rollouts``
    is set. An existing file (a resumed run) must be a recording of the same model and tokenizer, else
    a :class:`~agl_core.config.ConfigError`.
    """

    def __init__(self, config: Any, tokenizer: Any):
        if tokenizer is None:
            raise ConfigError(
                "agentlightning.record_rollouts", "recording needs the run's tokenizer, to fingerprint it"
            )
        self.path = Path(os.path.expanduser(str(config.trainer.default_local_dir))) / RECORDING_FILE
        self.secrets = _secret_values(config)
        header = _header(config, tokenizer)
        if self.path.is_file() and self.path.stat().st_size:
            recorded = _read_header(self.path)
            problem = mismatch(recorded, header)
            if problem:
                raise ConfigError(
                    "agentlightning.record_rollouts",
                    f"{self.path} is a recording of another model or tokenizer ({problem}): "
                    "record into another trainer.default_local_dir",
                )
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._append(header)

    def write(self, step: int, rollouts: Iterable[CompletedRollout]) -> dict[str, float]:
        """Append step ``step``; its metrics: the bytes written and the strings a secret was cut from."""
        counter = [0]
        line = {"step": step, "rollouts": [_scrub(r.to_dict(), self.secrets, counter) for r in rollouts]}
        return {BYTES_METRIC: float(self._append(line)), REDACTED_METRIC: float(counter[0])}

    def _append(self, record: Mapping[str, Any]) -> int:
        return _append_line(self.path, record)


def _append_line(path: Path, record: Mapping[str, Any]) -> int:
    """Append ``record`` to ``path`` as one JSON line; the bytes written."""
    data = (json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n").encode()
    with open(path, "ab") as f:
        f.write(data)
    return len(data)


@attrs.frozen
class Recording:
    """A recording read back: its ``path``, ``header`` and each step's rollouts (``steps``, by step
    number, in recorded order; a step written twice keeps its last line)."""

    path: Path
    header: dict[str, Any]
    steps: dict[int, tuple[CompletedRollout, ...]]

    def rollouts(self, step: int) -> tuple[CompletedRollout, ...]:
        """The rollouts of ``step``; a :class:`RecordingError` naming the file and the steps it holds."""
        if step not in self.steps:
            held = f"steps {min(self.steps)}..{max(self.steps)}" if self.steps else "no step"
            raise RecordingError(f"{self.path} has no step {step} (it holds {held})")
        return self.steps[step]

    def core_config(self) -> dict[str, Any]:
        """The recorded run's config, the keys the core schema knows (another backend's left out)."""
        return _schema_keys(self.header.get("config") or {}, default_config())

    def run_config(self) -> dict[str, Any]:
        """The recorded run's whole config (its backend's keys too; secrets hidden)."""
        return dict(self.header.get("config") or {})

    def save_step(self, step: int, path: str | os.PathLike[str], as_step: int = 1) -> Path:
        """Write a recording holding only ``step``, renumbered ``as_step``, to ``path`` (a new file;
        this recording's header): a run replaying it trains that step first."""
        target = Path(path)
        target.unlink(missing_ok=True)
        _append_line(target, self.header)
        _append_line(target, {"step": as_step, "rollouts": [r.to_dict() for r in self.rollouts(step)]})
        return target

    def check(self, config: Any, tokenizer: Any) -> None:
        """Refuse a recording whose model or tokenizer is not the run's: a :class:`RecordingError`
        naming the file, the first recorded step and what differs."""
        problem = mismatch(
            self.header, {"model": model_fingerprint(config), "tokenizer": tokenizer_fingerprint(tokenizer)}
        )
        if problem:
            first = min(self.steps) if self.steps else None
            raise RecordingError(f"{self.path} step {first}: recorded with another model or tokenizer: {problem}")


def _schema_keys(values: Mapping[str, Any], schema: Any) -> dict[str, Any]:
    """The part of ``values`` (a plain config) whose keys ``schema`` (a struct config) has (a
    user-keyed mapping, such as ``local.env_map``, is kept whole)."""
    from omegaconf import DictConfig

    out = {}
    for key, value in values.items():
        if key not in schema:
            continue
        node = schema.get(key)
        known = isinstance(node, DictConfig) and isinstance(value, Mapping) and OmegaConf.is_struct(node)
        out[key] = _schema_keys(value, node) if known else value
    return out


def _read_header(path: Path) -> dict[str, Any]:
    lines = read_json_objects(path)
    try:
        _, header = next(lines)
    except StopIteration:
        raise RecordingError(f"{path} is empty: not a rollout recording") from None
    except ValueError as exc:
        raise RecordingError(str(exc)) from None
    if header.get("format") != FORMAT:
        raise RecordingError(f"{path} line 1 is not a {FORMAT} header (format {header.get('format')!r})")
    if header.get("version") != FORMAT_VERSION:
        raise RecordingError(
            f"{path} is format version {header.get('version')!r}; this agl reads version {FORMAT_VERSION}"
        )
    return header


def read_recording(path: str | os.PathLike[str]) -> Recording:
    """Read the recording at ``path`` (a file, or a run directory holding ``rollouts.jsonl``).

    Every error is a :class:`RecordingError` naming the file, and the line or step."""
    file = recording_file(path)
    if not file.is_file():
        raise RecordingError(
            f"{file} does not exist: no rollout recording there (agentlightning.record_rollouts writes one)"
        )
    header = _read_header(file)
    steps: dict[int, tuple[CompletedRollout, ...]] = {}
    try:
        for number, record in read_json_objects(file):
            if number == 1:
                continue
            step = record.get("step")
            if not isinstance(step, int) or isinstance(step, bool) or not isinstance(record.get("rollouts"), list):
                raise RecordingError(
                    f"{file} line {number} is not a step record (an integer step and a list of rollouts)"
                )
            try:
                steps[step] = tuple(CompletedRollout.from_dict(r) for r in record["rollouts"])
            except (TypeError, ValueError) as exc:
                raise RecordingError(f"{file} line {number} (step {step}): {exc}") from None
    except RecordingError:
        raise
    except ValueError as exc:  # a line that is not JSON
        raise RecordingError(str(exc)) from None
    return Recording(file, header, steps)
