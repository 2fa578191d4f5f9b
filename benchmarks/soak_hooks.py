"""The verl soak's hook file (``benchmarks/bench_soak_verl.py``): the lifecycle hooks of
``bench_soak.Soak``, loaded in verl's trainer actor, where the rollout hooks run.

That actor works apart from the benchmark, so every call is appended to ``soak_hooks.jsonl`` in the
run directory (``trainer.default_local_dir``), one JSON line each, for the benchmark to read; a
``startup`` line opens each ``agl train`` run, which splits a killed and resumed run into segments.
``agl_on_succeeded`` raises on every ``SOAK_HOOK_RAISE_EVERY``-th call of the run (an environment
variable Ray's workers inherit from ``agl train``), after recording the outcome.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from agl_core import hookimpl

RECORDS = "soak_hooks.jsonl"
_lock = threading.Lock()
_state: dict[str, Any] = {"path": None, "n_succeeded": 0}


def _record(event: str, **fields: Any) -> None:
    line = json.dumps({"event": event, "t": time.time(), **fields}) + "\n"
    with _lock, Path(_state["path"]).open("a") as f:
        f.write(line)


@hookimpl
def agl_on_startup(config: Any, settings: Any) -> None:
    _state["path"] = str(Path(config.trainer.default_local_dir) / RECORDS)
    _record("startup", pid=os.getpid())


@hookimpl
def agl_on_enqueue(request: Any) -> None:
    if request.is_train:
        replaces = (request.metadata or {}).get("agl_replaces_rollout_id")
        _record("enqueue", rollout=request.rollout_id, group=request.group_id, replaces=replaces)


@hookimpl
def agl_on_succeeded(rollout: Any) -> None:
    _record("succeeded", rollout=rollout.rollout_id)
    with _lock:
        _state["n_succeeded"] += 1
        raises = _state["n_succeeded"] % int(os.environ.get("SOAK_HOOK_RAISE_EVERY", "25")) == 0
    if raises:
        _record("raised", rollout=rollout.rollout_id)
        raise RuntimeError("soak: this hook raises on schedule")


@hookimpl
def agl_on_failed(rollout: Any) -> None:
    _record("failed", rollout=rollout.rollout_id)
