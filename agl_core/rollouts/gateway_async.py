"""The asynchronous rollout source backed by the real Agent Lightning gateway.

It is the synchronous source of :mod:`agl_core.rollouts.gateway_sync` with groups kept in flight
across steps, and the gateway's proxy paused and drained around each weight update.

What it carries across steps survives a checkpoint (:meth:`AsyncGatewayRolloutSource.state`): the
groups in flight (their rollouts already finished and read, and the requests of those still
pending) and the samples waiting in the backlog. A resumed run restores them before its first step:
pending rollouts the gateway still holds are polled again under their ids (those that finished
while no trainer ran are read then); those it no longer holds (a gateway restart, or a run killed
after the checkpoint that had read and deleted them) are re-created with the same request under a
fresh id, as after a gateway restart. A pending rollout that failed before the resumed run
registered its engines, or whose attempt was already running when the run restored it (the
gateway's ``updated_at`` against this process's clock: its agent could reach only the stopped run's
engines, and a call in flight to them fails when the proxy gives up, possibly after the new
registration), is re-created the same way, per ``gateway.restart_policy``
(``training/async/n_resumed_failed_unserved``). Nothing carried is dropped or trained twice, and the
restore is counted (``training/async/n_resumed_*``, ``training/rollouts/n_lost``, ``n_reenqueued``).

**The staleness bound** is verl V1's (``trainer.v1.sampler.max_off_policy_threshold`` and
``max_off_policy_strategy``, with verl's meaning and metric names): a group submitted at step ``s``
spans ``g - s + 1`` policy versions when step ``g`` trains on it, and is stale once that passes the
threshold. ``drop`` evicts stale groups as they finish (``training/off_policy/evicted_samples``, the
groups, and their ``evicted_samples_staleness/{mean,max,min}``) and tops the groups in flight up
with fresh samples, from the backlog and then from ``next_samples`` when the backend gave it
(``training/off_policy/n_refilled_groups``). ``wait`` never evicts: before a step takes its groups,
it waits until every group in flight whose span has reached the threshold has finished, so it can be
trained (``training/off_policy/n_waited_groups``, ``training/off_policy/wait_s``). With a bound, a
step takes its groups oldest first (by step, then completion); without one (``null``), in completion
order, as Agent Lightning v1.0 does. ``training/off_policy/trained_staleness/{mean,max}`` is the span
of the groups a step trains on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from omegaconf import DictConfig

from agl_core.data import CompletedRollout, RolloutRequest
from agl_core.plugins import PluginManager
from agl_core.rollouts.gateway_client import GatewayClient
from agl_core.rollouts.gateway_sync import GatewayRolloutSource, Group, _Pending
from agl_core.rollouts.source import RolloutBatch

__all__ = ["AsyncGatewayRolloutSource"]

logger = logging.getLogger(__name__)


class AsyncGatewayRolloutSource(GatewayRolloutSource):
    """Async mode: ``async_train_batch_size`` training groups stay in flight; a step takes the first
    ``train_batch_size`` whose rollouts are all terminal, and unfinished groups carry over whole
    (keeping their original step) while only the difference is topped up. Samples beyond what the
    top-up needs wait in a backlog for the next step, in order. Validation runs synchronously.

    Around the weight update: :meth:`before_weight_update` pauses the proxy and waits (up to
    ``gateway.drain_timeout_seconds``) for in-flight model calls to end; :meth:`after_weight_update`
    registers the new endpoints, then resumes, so agents never see an empty model table.
    """

    def __init__(self, config: DictConfig, plugins: PluginManager, client: GatewayClient | None = None):
        super().__init__(config, plugins, client)
        self.train_batch_size = int(config.data.train_batch_size)
        self.in_flight = int(config.agentlightning.async_rollout.async_train_batch_size)
        sampler = config.trainer.v1.sampler
        self.threshold: int | None = sampler.max_off_policy_threshold  # None: no staleness bound
        self.strategy: str = sampler.max_off_policy_strategy
        self.backlog: list[Mapping[str, Any]] = []
        self.paused = False

    def _train_groups(self) -> list[Group]:
        return [g for g in self.groups.values() if g.is_train]

    def _top_up(self, step: int, *, refill: bool = False) -> int:
        """Enqueue backlog samples until ``async_train_batch_size`` groups are in flight; with
        ``refill``, first draw batches from ``next_samples`` while the backlog is short. The groups enqueued."""
        need = max(0, self.in_flight - len(self._train_groups()))
        while refill and len(self.backlog) < need and self.next_samples is not None:
            more = list(self.next_samples())
            if not more:
                break
            self.backlog.extend(more)
        take, self.backlog = self.backlog[:need], self.backlog[need:]
        self._enqueue(take, step=step, is_train=True)
        return len(take)

    def _stale(self, group: Group, step: int, *, reached: bool = False) -> bool:
        """Whether ``group``'s span at ``step`` passes the threshold (``reached``: has reached it)."""
        if self.threshold is None:
            return False
        span = step - group.step + 1
        return span >= self.threshold if reached else span > self.threshold

    def collect(self, samples: Sequence[Mapping[str, Any]], *, step: int, is_train: bool) -> RolloutBatch:
        if not is_train:
            return super().collect(samples, step=step, is_train=False)
        carried = self._train_groups()
        n_prev = sum(g.size - len(g.done) for g in carried)
        self.backlog.extend(samples)
        self._top_up(step)
        drop = self.strategy == "drop"
        evicted: list[Group] = []
        refilled = 0
        waited: set[str] = set()
        wait_started: float | None = None

        def sampleable() -> bool:
            nonlocal wait_started
            groups = self._train_groups()
            if drop and any(g.complete and self._stale(g, step) for g in groups):
                return True  # evict it first
            if sum(g.complete for g in groups) < min(self.train_batch_size, len(groups)):
                return False
            blocking = [] if drop else [g for g in groups if not g.complete and self._stale(g, step, reached=True)]
            if blocking and wait_started is None:
                wait_started = time.monotonic()
            waited.update(g.group_id for g in blocking)
            return not blocking

        while True:
            self._wait(sampleable)
            stale = [g for g in self._train_groups() if drop and g.complete and self._stale(g, step)]
            if not stale:
                break
            for group in stale:
                del self.groups[group.group_id]
            evicted += stale
            refilled += self._top_up(step, refill=True)
        target = min(self.train_batch_size, len(self._train_groups()))
        order = (lambda g: g.completed_at) if self.threshold is None else (lambda g: (g.step, g.completed_at))
        ready = sorted((g for g in self._train_groups() if g.complete), key=order)[:target]
        rest = [g for g in self._train_groups() if g not in ready]
        extra = {
            "training/async/n_prev_carry_over_rollouts": float(n_prev),
            "training/async/n_completed_rollouts": float(sum(len(g.done) for g in ready)),
            "training/async/n_new_carry_over_rollouts": float(sum(g.size - len(g.done) for g in rest)),
            "training/async/new_carry_over_age_max_steps": float(max((step - g.step for g in rest), default=0)),
            "training/async/n_backlog_samples": float(len(self.backlog)),
            **self._off_policy_metrics(step, ready, evicted, refilled, waited, wait_started),
        }
        return self._batch(ready, extra)

    def _off_policy_metrics(
        self,
        step: int,
        ready: Sequence[Group],
        evicted: Sequence[Group],
        refilled: int,
        waited: set[str],
        wait_started: float | None,
    ) -> dict[str, float]:
        """The staleness bound's counts (verl's names for evictions) and the span of the trained groups."""
        spans = [step - g.step + 1 for g in ready]
        metrics = {
            "training/off_policy/trained_staleness/mean": float(np.mean(spans)) if spans else 0.0,
            "training/off_policy/trained_staleness/max": float(max(spans, default=0)),
        }
        if self.threshold is None:
            return metrics
        if self.strategy == "wait":
            metrics["training/off_policy/n_waited_groups"] = float(len(waited))
            metrics["training/off_policy/wait_s"] = 0.0 if wait_started is None else time.monotonic() - wait_started
            return metrics
        metrics["training/off_policy/evicted_samples"] = float(len(evicted))
        metrics["training/off_policy/n_evicted_rollouts"] = float(sum(len(g.done) for g in evicted))
        metrics["training/off_policy/n_refilled_groups"] = float(refilled)
        if evicted:
            evicted_spans = np.array([step - g.step + 1 for g in evicted], dtype=float)
            prefix = "training/off_policy/evicted_samples_staleness"
            metrics |= {
                f"{prefix}/mean": float(evicted_spans.mean()),
                f"{prefix}/max": float(evicted_spans.max()),
                f"{prefix}/min": float(evicted_spans.min()),
            }
        return metrics

    def before_weight_update(self) -> dict[str, float]:
        """Pause the proxy and wait for in-flight model calls to reach zero, up to the drain deadline."""
        start = time.monotonic()
        state = self.client.pause(self.gateway.pause_retry_after_seconds, reason="weight update")
        self.paused = True
        at_pause = int(state.get("inflight", 0))
        inflight, interval = at_pause, self.gateway.poll_interval_min_seconds
        deadline = start + self.gateway.drain_timeout_seconds
        while inflight > 0 and time.monotonic() < deadline:
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
            interval = min(self.gateway.poll_interval_max_seconds, interval * 1.5)
            inflight = int(self.client.proxy_state().get("inflight", 0))
        if inflight > 0:
            logger.warning("drain deadline passed with %d model calls still in flight", inflight)
        return {
            "training/async/proxy_inflight_at_pause": float(at_pause),
            "training/async/proxy_drain_seconds": time.monotonic() - start,
            "training/async/proxy_inflight_after_drain": float(inflight),
            "training/async/drain_timed_out": float(inflight > 0),
        }

    def after_weight_update(self, endpoints: Sequence[str], version: int) -> None:
        super().after_weight_update(endpoints, version)
        if self.paused:
            self.client.resume()
            self.paused = False

    # -- checkpoints ----------------------------------------------------------------------------

    def state(self) -> dict[str, Any] | None:
        """The training groups in flight (complete ones first, in the order they completed), the
        requests of their pending rollouts and the backlog, as plain data."""
        groups = sorted(self._train_groups(), key=lambda g: (g.completed_at is None, g.completed_at or 0.0))
        in_flight = {g.group_id for g in groups}
        return {
            "groups": [
                {
                    "group_id": g.group_id,
                    "step": g.step,
                    "size": g.size,
                    "done": [[rid, None if r is None else r.to_dict()] for rid, r in g.done.items()],
                }
                for g in groups
            ],
            "pending": [
                {"request": p.request.to_dict(), "queued_at": p.queued_at, "reenqueues": p.reenqueues}
                for p in self.pending.values()
                if p.request.group_id in in_flight
            ],
            "backlog": [dict(sample) for sample in self.backlog],
        }

    def restore(self, state: Mapping[str, Any]) -> int:
        """Take over the groups, pending rollouts and backlog of ``state`` (see the module's
        docstring); return how many samples they are (groups in flight + backlog)."""
        now = time.monotonic()
        for saved in state["groups"]:
            done = {rid: None if r is None else CompletedRollout.from_dict(r) for rid, r in saved["done"]}
            group = Group(saved["group_id"], int(saved["step"]), True, int(saved["size"]), done)
            group.completed_at = now if group.complete else None  # saved in completion order
            self.groups[group.group_id] = group
        for saved in state["pending"]:
            request = RolloutRequest.from_dict(saved["request"])
            self.pending[request.rollout_id] = _Pending(
                request, saved["queued_at"], now + self.deadline_seconds, saved["reenqueues"], restored=True
            )
        self.backlog = list(state["backlog"]) + self.backlog
        self.cursor = 0  # what finished while no trainer ran is in the terminal log from its start
        kept = len(self.pending)
        statuses = self._statuses(list(self.pending))
        for rid, status in statuses.items():
            if status is not None and status.get("state") == "running":
                self.pending[rid].running_since = status.get("updated_at")  # its attempt's start
        self._handle_lost([rid for rid, status in statuses.items() if status is None])
        self.counts["training/async/n_resumed_groups"] += len(state["groups"])
        self.counts["training/async/n_resumed_pending_rollouts"] += kept
        self.counts["training/async/n_resumed_finished_rollouts"] += sum(len(g["done"]) for g in state["groups"])
        self.counts["training/async/n_resumed_backlog_samples"] += len(state["backlog"])
        return len(state["groups"]) + len(state["backlog"])
