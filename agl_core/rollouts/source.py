"""The interface between a backend and whatever runs the agents (the gateway, or the embedded runtime).

A backend only sees :class:`RolloutSource`: it hands over dataset samples and gets back completed
rollouts of whole groups. How the agents run, and how completion is detected, is the source's
business. :func:`make_requests` is the one place where samples become rollout requests, so grouping
and the ``agl_on_enqueue`` chain are the same for every source.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
from omegaconf import DictConfig

from agl_core.config import ConfigError
from agl_core.data import CompletedRollout, RolloutRequest
from agl_core.errors import UsageError, UsageTypeError
from agl_core.plugins import PluginManager


@attrs.frozen
class RolloutBatch:
    """What one ``collect`` returns: completed rollouts (whole groups only) and the source's metrics."""

    rollouts: tuple[CompletedRollout, ...] = attrs.field(converter=tuple)
    metrics: dict[str, float] = attrs.field(factory=dict)


@attrs.frozen
class FinishedGroup:
    """A group whose ``size`` rollouts are all terminal, as a streaming source hands it over: the
    ``rollouts`` kept (a failed one the failed-rollout policy skips is not among them; the source
    counts it)."""

    group_id: str
    step: int
    is_train: bool
    size: int
    rollouts: tuple[CompletedRollout, ...] = attrs.field(converter=tuple)


class RolloutSource(Protocol):
    """What a backend holds to get rollouts; every source subclasses it explicitly.

    ``on_rollout_done``, when a backend sets it, is called with each rollout a source will return as
    soon as that rollout is done and kept (the step pipeline's
    :meth:`~agl_core.stages.pipeline.StepPipeline.prepare_rollout`), so per-rollout work runs while
    other rollouts still run. A source that only has its rollouts once all are done need not call it.

    ``next_samples``, when a backend sets it, gives the next dataset batch (the data position
    advances) to a source that needs samples beyond those ``collect`` was handed: the async gateway
    source replacing the groups its staleness bound evicted. Without it, such a source tops up at
    the next ``collect``.
    """

    on_rollout_done: Callable[[CompletedRollout], None] | None = None
    next_samples: Callable[[], Sequence[Mapping[str, Any]]] | None = None

    def collect(self, samples: Sequence[Mapping[str, Any]], *, step: int, is_train: bool) -> RolloutBatch:
        """Run rollouts for ``samples`` (``rollout.n`` each when training, one when validating) and return
        the completed ones. In async mode the samples top up the groups in flight, and the first
        ``train_batch_size`` complete groups are returned; unfinished groups carry over."""

    def before_weight_update(self) -> dict[str, float]:
        """Called just before the optimizer step changes the policy (async: pause and drain the gateway).
        Returns metrics."""

    def after_weight_update(self, endpoints: Sequence[str], version: int) -> None:
        """Called once the serving engines hold the new weights: register ``endpoints`` with
        ``version`` (the training step) and resume."""

    def close(self) -> None:
        """Stop whatever the source started."""

    def state(self) -> dict[str, Any] | None:
        """What a checkpoint taken between steps must keep for a resumed run to continue the rollouts
        this source carries into the next step (async: its groups in flight and waiting samples), as
        plain data; ``None`` when it carries none (a sync source finishes its groups within a step)."""
        return None

    def restore(self, state: Mapping[str, Any]) -> int:
        """Carry on from ``state`` (what :meth:`state` returned in the run being resumed), before the
        first step; return how many samples that carries into the next step. Only a source that
        carries rollouts across steps can."""
        raise ConfigError(
            "agentlightning.async_rollout.enabled",
            "the checkpoint holds rollouts in flight between steps, which only the async gateway source continues: "
            "resume with async rollout enabled (or start the run over with trainer.resume_mode=disable)",
        )


def new_id() -> str:
    return uuid.uuid4().hex


REPLACES_KEY = "agl_replaces_rollout_id"


def recreate_request(request: RolloutRequest, plugins: PluginManager) -> RolloutRequest:
    """``request`` again, for a rollout that must run anew (its gateway restarted, or a resumed run
    found it gone): under a fresh ``rollout_id``, so a stale agent of the old one cannot write into
    it, with ``metadata[REPLACES_KEY]`` naming the id it replaces, and through the ``agl_on_enqueue``
    chain as a new request goes, so every rollout whose end a hook sees was enqueued before it."""
    metadata = {**request.metadata, REPLACES_KEY: request.rollout_id}
    return plugins.enqueue(attrs.evolve(request, rollout_id=new_id(), metadata=metadata))


def make_requests(
    samples: Sequence[Mapping[str, Any]],
    *,
    n: int,
    step: int,
    is_train: bool,
    rollout_config: Mapping[str, Any],
    plugins: PluginManager,
    group_ids: Sequence[str] | None = None,
) -> list[list[RolloutRequest]]:
    """One group per sample, ``n`` requests per group, each passed through the ``agl_on_enqueue`` chain.

    Every group gets a fresh ``group_id`` (Agent Lightning's ``data_id``; ``group_ids[i]`` for
    sample ``i`` when the caller chose them, as verl's prompt uids) and every request a
    client-chosen ``rollout_id``, so creating them is idempotent; ``plugins.enqueue`` runs the hooks.
    """
    if group_ids is not None and len(group_ids) != len(samples):
        raise UsageError(f"{len(samples)} samples but {len(group_ids)} group ids")
    groups = []
    for sample_index, sample in enumerate(samples):
        if not isinstance(sample, Mapping):
            raise UsageTypeError(f"dataset sample {sample_index} must be a mapping, got {type(sample).__name__}")
        group_id = new_id() if group_ids is None else str(group_ids[sample_index])
        group = []
        for _ in range(n if is_train else 1):
            request = RolloutRequest(
                rollout_id=new_id(),
                group_id=group_id,
                input=sample,
                is_train=is_train,
                step=step,
                sample_index=sample_index,
                config=rollout_config,
            )
            group.append(plugins.enqueue(request))
        groups.append(group)
    return groups


def rollout_config(config: DictConfig) -> dict[str, Any]:
    """The controller-facing config every rollout carries, built once at start.

    ``k8s.job_template`` is the text of ``agentlightning.k8s.job_template_path``; a missing or
    unreadable file is a :class:`~agl_core.config.ConfigError` before any rollout is created.
    """
    agl = config.agentlightning
    template = None
    path = agl.k8s.job_template_path
    if path:
        try:
            with open(os.fspath(path), encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("agentlightning.k8s.job_template_path", f"cannot read {path}: {exc}") from exc
    return {
        "timeout_seconds": int(agl.rollout_timeout_seconds),
        "local": {"agent_class": agl.local.agent_class, "env_map": {k: str(v) for k, v in agl.local.env_map.items()}},
        "k8s": {"job_template": template},
    }
