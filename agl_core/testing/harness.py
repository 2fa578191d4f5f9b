"""Run real training steps with your plugins, in seconds, and look at what they did.

::

    from agl_core.testing.harness import run_training

    run = run_training(plugins=[my_plugin], overrides={"algorithm.adv_estimator": "my_estimator"}, steps=2)
    assert run.metrics[-1]["training/n_sample"] > 0
    assert all(e.event_type == "reward" for e in run.events)

It trains the reference ``torch`` backend with the embedded rollout source on
:mod:`agl_core.testing.tiny_task` (a tiny policy built once per process in a temporary folder),
through :func:`agl_core.runs.train.run`, the same entry as ``agl train``. Third-party entry points are not
loaded (the plugins under test are the ones given), and the run validates once before training, so
lifecycle hooks see validation rollouts too (``rollout.is_train`` false), as in any run. In pytest,
the ``agl_training`` fixture is :func:`run_training` with the run folder under the test's
``tmp_path``.

:class:`TrainingRun` holds each step's metrics (``metrics.jsonl``), every rollout as the lifecycle
hooks saw it, every request as the ``agl_on_enqueue`` chain left it, and the events the hooks wrote.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from agl_core.data import CompletedRollout, RolloutRequest
from agl_core.files.jsonl import read_json_objects
from agl_core.hookspecs import hookimpl
from agl_core.plugins import DISABLE_AUTOLOAD_ENV, EventWriter, PendingEvent
from agl_core.testing import tiny_task

__all__ = ["TrainingRun", "run_training", "tiny_policy", "training_runner"]


@attrs.frozen
class TrainingRun:
    """What a harness run left: ``metrics`` has one dict per ``metrics.jsonl`` line (step 0 is the
    validation before training); ``rollouts`` and ``requests`` are in the order the hooks saw them."""

    run_dir: Path
    metrics: list[dict[str, Any]]
    rollouts: list[CompletedRollout]
    requests: list[RolloutRequest]
    events: list[PendingEvent]

    @property
    def train_rollouts(self) -> list[CompletedRollout]:
        return [r for r in self.rollouts if r.is_train]

    @property
    def val_rollouts(self) -> list[CompletedRollout]:
        return [r for r in self.rollouts if not r.is_train]

    def step(self, step: int) -> dict[str, Any]:
        """The metrics logged for ``step`` (0: the validation before training)."""
        for line in self.metrics:
            if line["step"] == step:
                return line
        raise KeyError(f"no metrics for step {step}; logged steps: {[line['step'] for line in self.metrics]}")


class _Recorder:
    """A plugin that runs after every other and keeps what the lifecycle hooks saw and wrote."""

    def __init__(self) -> None:
        self.rollouts: list[CompletedRollout] = []
        self.requests: list[RolloutRequest] = []
        self.events: list[PendingEvent] = []

    @hookimpl(trylast=True)
    def agl_on_enqueue(self, request: RolloutRequest) -> None:
        self.requests.append(request)

    @hookimpl(trylast=True)
    def agl_on_succeeded(self, rollout: CompletedRollout, writer: EventWriter) -> None:
        self.rollouts.append(rollout)
        self.events.extend(writer.pending)

    @hookimpl(trylast=True)
    def agl_on_failed(self, rollout: CompletedRollout, writer: EventWriter) -> None:
        self.agl_on_succeeded(rollout, writer)


_POLICY_FOLDERS: list[tempfile.TemporaryDirectory[str]] = []  # removed when the process exits


@functools.cache
def tiny_policy(seed: int = 0) -> Path:
    """The tiny task's policy, built once per process and seed in a temporary folder."""
    folder = tempfile.TemporaryDirectory(prefix="agl-tiny-policy-")
    _POLICY_FOLDERS.append(folder)
    return tiny_task.build_policy(Path(folder.name), seed)


def _overrides(run_dir: Path, steps: int, seed: int, overrides: Mapping[str, Any] | Sequence[str]) -> list[str]:
    data = run_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    train = tiny_task.write_dataset(data / "train.jsonl", 16, 2, seed)
    val = tiny_task.write_dataset(data / "val.jsonl", 2, 2, seed + 1)
    base = {
        "agentlightning.local.agent_class": f"{tiny_task.__name__}:{tiny_task.TinyWordAgent.__name__}",
        f"agentlightning.local.env_map.{tiny_task.WORDS_ENV}": "input.words",
        "agentlightning.rollout_timeout_seconds": 120,
        "agentlightning.torch.device": "cpu",
        "agentlightning.torch.num_threads": 1,
        "agentlightning.trace_aggregator.trajectory_max_prompt_length": 128,
        "agentlightning.trace_aggregator.trajectory_max_response_length": 64,
        "data.train_files": train,
        "data.val_files": val,
        "data.train_batch_size": 2,
        "actor_rollout_ref.model.path": tiny_policy(seed),
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "actor_rollout_ref.actor.optim.lr": 1e-3,
        "actor_rollout_ref.actor.optim.lr_warmup_steps": 0,
        "trainer.total_training_steps": steps,
        "trainer.default_local_dir": run_dir / "run",
        "trainer.seed": seed,
    }
    given = overrides.items() if isinstance(overrides, Mapping) else (o.split("=", 1) for o in overrides)
    base.update(dict(given))
    return [f"{key}={_yaml(value)}" for key, value in base.items()]


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def run_training(
    plugins: Iterable[Any] = (),
    overrides: Mapping[str, Any] | Sequence[str] = (),
    steps: int = 2,
    run_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
) -> TrainingRun:
    """Train ``steps`` steps of the tiny task with ``plugins`` registered in code.

    ``overrides`` are config keys (a mapping, or ``key=value`` strings) over the harness's defaults:
    ``data.train_batch_size=2``, ``actor_rollout_ref.rollout.n=2``, ``trajectory`` aggregation, ``grpo``,
    ``per_rollout_mean``, validation before training on two rows. ``run_dir`` defaults to a new
    temporary folder.
    """
    from agl_core.runs.train import run

    folder = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="agl-harness-"))
    recorder = _Recorder()
    previous = os.environ.get(DISABLE_AUTOLOAD_ENV)
    os.environ[DISABLE_AUTOLOAD_ENV] = "1"  # only the plugins under test, whatever else is installed
    try:
        out = run(None, _overrides(folder, steps, seed, overrides), [*plugins, recorder], show_progress=False)
    finally:
        if previous is None:
            os.environ.pop(DISABLE_AUTOLOAD_ENV, None)
        else:
            os.environ[DISABLE_AUTOLOAD_ENV] = previous
    metrics = [record for _, record in read_json_objects(out / "metrics.jsonl")]
    return TrainingRun(out, metrics, recorder.rollouts, recorder.requests, recorder.events)


def training_runner(root: Path) -> Callable[..., TrainingRun]:
    """:func:`run_training` with each run's folder under ``root`` (what the ``agl_training`` fixture gives)."""
    runs = iter(range(1_000_000))

    def train(
        plugins: Iterable[Any] = (), overrides: Mapping[str, Any] | Sequence[str] = (), steps: int = 2, seed: int = 0
    ) -> TrainingRun:
        return run_training(plugins, overrides, steps, root / f"harness-{next(runs)}", seed)

    return train
