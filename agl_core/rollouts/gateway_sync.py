"""The synchronous rollout source backed by the real Agent Lightning gateway.

It creates rollouts in batches with client-chosen ids, then learns what finished from the gateway's
terminal cursor (``GET /api/rollouts/terminal?after=N``): one request per poll however many rollouts
are pending, with a poll interval that drops to ``poll_interval_min_seconds`` while rollouts finish
and backs off to ``poll_interval_max_seconds`` while none do. A finished rollout costs one events
read and one delete (plus a record read when it failed, for its error message).

Every wait is bounded. A rollout still pending ``rollout_timeout_seconds +
rollout_timeout_grace_seconds`` after its creation is failed on the trainer side. A gateway restart
(the terminal log shrinks, or a known rollout answers 404) is detected, counted, and the lost
rollouts are re-created under fresh ids or failed (``gateway.restart_policy``); the registered
models are registered again. The gateway being unreachable is survived until those deadlines.

Each rollout is finished by :func:`~agl_core.rollouts.finish.finish_rollout` as it is read: what its
lifecycle hooks write is appended to the gateway (retried as the client's retry policy allows), and
the rollout's events are re-read when anything was written.

Reading is off the step's critical path: rollouts are read, decoded and parsed at the poll that sees
them terminal, while the others still run, so what is left when the last one finishes is that one's
read. The reads run concurrently, at most ``READ_WORKERS`` ahead of the rollout being finished, and
a decoded body is dropped once parsed: a step holds a few rollouts' bodies, never its batch's.
Events are decoded with only the fields the parser reads, unless an ``agl_on_succeeded`` hook is
registered (hooks get the events in full). Each kept rollout is handed to ``on_rollout_done`` (the
step pipeline's per-rollout work) as it is finished.

Each report (a step's batch) says how fast the source finished rollouts since the previous one and
how long finished rollouts waited to be read (``timing/rollout_source/*``,
:func:`~agl_core.rollouts.events.source_metrics`): with many agents against the gateway, the
trainer's side of the throughput.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from typing import Any

import attrs
from omegaconf import DictConfig

from agl_core.config import ConfigError
from agl_core.data import CompletedRollout, RolloutRequest
from agl_core.plugins import EventWriter, PendingEvent, PluginManager
from agl_core.rollouts.events import (
    FailedRolloutPolicy,
    apply_failed_policy,
    last_event_time,
    rollout_timing_metrics,
    source_metrics,
)
from agl_core.rollouts.finish import finish_rollout
from agl_core.rollouts.gateway_client import GatewayClient, GatewayError
from agl_core.rollouts.source import (
    FinishedGroup,
    RolloutBatch,
    RolloutSource,
    make_requests,
    recreate_request,
    rollout_config,
)

__all__ = ["GatewayRolloutSource", "Group"]

logger = logging.getLogger(__name__)

CREATE_CHUNK = 256
READ_WORKERS = 8  # concurrent events reads / deletes of rollouts that finished together
TERMINAL_PAGE = 1000


@attrs.define
class _Pending:
    request: RolloutRequest
    queued_at: float  # wall clock
    deadline: float  # monotonic
    reenqueues: int = 0
    restored: bool = False  # taken over from a checkpoint (async mode's restore)
    running_since: float | None = None  # restored while running: the gateway's time its attempt started


@attrs.define
class Group:
    group_id: str
    step: int
    is_train: bool
    size: int
    done: dict[str, CompletedRollout | None] = attrs.field(factory=dict)  # None: failed and skipped
    completed_at: float | None = None  # monotonic, once every member is terminal

    @property
    def complete(self) -> bool:
        return len(self.done) == self.size

    def rollouts(self) -> list[CompletedRollout]:
        return [r for r in self.done.values() if r is not None]


class GatewayRolloutSource(RolloutSource):
    """Synchronous mode: each ``collect`` enqueues its samples and returns once all of them are terminal."""

    runs_in_poll = False  # streaming: the agents run under the controller, a poll only reads the gateway

    def __init__(self, config: DictConfig, plugins: PluginManager, client: GatewayClient | None = None):
        agl = config.agentlightning
        if not agl.agl_base_url and client is None:
            raise ConfigError("agentlightning.agl_base_url", "the gateway rollout source needs the gateway's URL")
        self.plugins = plugins
        self.client = client or GatewayClient.from_config(config)
        self.rollout_config = rollout_config(config)
        gateway: DictConfig = agl.gateway
        self.gateway = gateway
        self.n = int(config.actor_rollout_ref.rollout.n)
        self.model_name = config.actor_rollout_ref.model.path
        self.reward_fillna_value = float(agl.reward_fillna_value)
        self.failed_rollout_policy: FailedRolloutPolicy = agl.failed_rollout_policy
        self.deadline_seconds = float(agl.rollout_timeout_seconds) + float(agl.rollout_timeout_grace_seconds)
        self.pending: dict[str, _Pending] = {}
        self._pool = ThreadPoolExecutor(max_workers=READ_WORKERS, thread_name_prefix="agl-gateway-read")
        self.terminal: dict[str, str] = {}  # pending rollouts the cursor reported terminal, not yet read
        self.groups: dict[str, Group] = {}
        self.cursor = 0
        self.poll_interval = float(gateway.poll_interval_min_seconds)
        self.last_progress = time.monotonic()
        self.registered: tuple[list[str], int] | None = None
        self.serving_since: float | None = None  # wall clock of this source's first registration
        self.counts: Counter[str] = Counter()
        self._requests_at_last_report = Counter(self.client.requests_sent)
        self._reported_at = time.monotonic()
        self._pickups: list[float] = []  # seconds from each read rollout's last event to its reading

    # -- creating -----------------------------------------------------------------------------

    def _enqueue(
        self,
        samples: Sequence[Mapping[str, Any]],
        *,
        step: int,
        is_train: bool,
        group_ids: Sequence[str] | None = None,
    ) -> list[Group]:
        batches = make_requests(
            samples,
            n=self.n,
            step=step,
            is_train=is_train,
            rollout_config=self.rollout_config,
            plugins=self.plugins,
            group_ids=group_ids,
        )
        groups = []
        for requests in batches:
            group = Group(requests[0].group_id, step, is_train, len(requests))
            self.groups[group.group_id] = group
            groups.append(group)
        self._create([r for requests in batches for r in requests])
        return groups

    def _create(self, requests: list[RolloutRequest], reenqueues: int = 0) -> None:
        for start in range(0, len(requests), CREATE_CHUNK):
            chunk = requests[start : start + CREATE_CHUNK]
            self.client.create_rollouts(chunk)
            now, mono = time.time(), time.monotonic()
            for r in chunk:
                self.pending[r.rollout_id] = _Pending(r, now, mono + self.deadline_seconds, reenqueues)
        self.counts["training/rollouts/n_created"] += len(requests)

    # -- waiting ------------------------------------------------------------------------------

    def _wait(self, done: Callable[[], bool]) -> None:
        """Poll until ``done()``; every pending rollout has a deadline, so this ends."""
        while not done():
            progressed = self._poll_once()
            if done():
                return
            low, high = self.gateway.poll_interval_min_seconds, self.gateway.poll_interval_max_seconds
            self.poll_interval = low if progressed else min(high, self.poll_interval * 1.5)
            nearest = min((p.deadline for p in self.pending.values()), default=time.monotonic())
            time.sleep(max(0.0, min(self.poll_interval, nearest - time.monotonic() + 0.01)))

    def _poll_once(self) -> bool:
        """Read the terminal cursor, process what finished, enforce deadlines. True if anything finished."""
        finished = 0
        try:
            while True:
                page = self.client.terminal_page(self.cursor, TERMINAL_PAGE)
                if page["total_terminal"] < self.cursor:
                    self._recover_from_restart("the terminal log restarted")
                    return True
                self.cursor = page["next_after"]
                for item in page["items"]:
                    if item["rollout_id"] in self.pending:
                        self.terminal[item["rollout_id"]] = item["state"]
                if self.cursor >= page["total_terminal"]:
                    break
            finished = self._finish_terminal()
            if finished:
                self.last_progress = time.monotonic()
            elif self.pending and time.monotonic() - self.last_progress > self.gateway.liveness_check_seconds:
                self._check_liveness()
        except GatewayError as exc:
            if not exc.not_found and not exc.transient:
                raise
            self.counts["training/gateway/n_poll_errors"] += 1
            logger.warning("gateway poll failed, will retry until the rollouts' deadlines: %s", exc)
        return self._expire() + finished > 0

    def _check_liveness(self) -> None:
        """No progress for a while: does the oldest pending rollout still exist?"""
        self.last_progress = time.monotonic()
        oldest = min(self.pending.values(), key=lambda p: p.queued_at)
        try:
            self.client.get_rollout(oldest.request.rollout_id)
        except GatewayError as exc:
            if not exc.not_found:
                raise
            self._recover_from_restart(f"rollout {oldest.request.rollout_id} is unknown to the gateway")

    def _expire(self) -> int:
        now = time.monotonic()
        expired = [rid for rid, p in self.pending.items() if p.deadline <= now]
        for rid in expired:
            self.counts["training/rollouts/n_timed_out"] += 1
            self._fail(rid, f"trainer-side timeout: not terminal after {self.deadline_seconds:.0f}s", read_events=True)
            self._delete(rid)
        return len(expired)

    # -- gateway restarts ---------------------------------------------------------------------

    def _recover_from_restart(self, why: str) -> None:
        logger.warning("gateway restart detected (%s); checking %d pending rollouts", why, len(self.pending))
        self.counts["training/gateway/n_restarts_detected"] += 1
        self.cursor = 0
        self.last_progress = time.monotonic()
        if self.registered is not None:
            self._register(*self.registered)
        self._handle_lost(self._unknown_to_gateway(list(self.pending)))

    def _unknown_to_gateway(self, rollout_ids: list[str]) -> list[str]:
        """Which of ``rollout_ids`` the gateway no longer holds (one read each)."""
        return [rid for rid, status in self._statuses(rollout_ids).items() if status is None]

    def _statuses(self, rollout_ids: list[str]) -> dict[str, dict[str, Any] | None]:
        """Each rollout's lifecycle status at the gateway (``state``, ``updated_at``...; one read
        each); ``None`` for one the gateway no longer holds."""
        statuses: dict[str, dict[str, Any] | None] = {}
        for rid in rollout_ids:
            try:
                statuses[rid] = self.client.get_rollout(rid)["rollout"]["status"]
            except GatewayError as exc:
                if not exc.not_found:
                    raise
                statuses[rid] = None
        return statuses

    def _handle_lost(self, lost: list[str]) -> None:
        """Re-create each lost rollout under a fresh id (so a stale agent of the old one cannot write
        into it), or fail it, per ``gateway.restart_policy`` and ``gateway.max_reenqueues``."""
        for rid in lost:
            if not self._reenqueue(rid):
                self._fail(rid, "lost by the gateway (restarted) and not re-enqueued", read_events=False)
            self.counts["training/rollouts/n_lost"] += 1

    def _reenqueue(self, rid: str) -> bool:
        """Re-create pending rollout ``rid`` under a fresh id if ``gateway.restart_policy`` and
        ``gateway.max_reenqueues`` allow it; whether it was."""
        pending = self.pending[rid]
        if self.gateway.restart_policy != "reenqueue" or pending.reenqueues >= self.gateway.max_reenqueues:
            return False
        self._create([recreate_request(pending.request, self.plugins)], pending.reenqueues + 1)
        del self.pending[rid]
        self.terminal.pop(rid, None)
        self.counts["training/rollouts/n_reenqueued"] += 1
        return True

    def _failed_unserved(self, rid: str, failed_at: Any) -> bool:
        """Whether restored rollout ``rid`` failed (at ``failed_at``, the gateway's ``updated_at``)
        before this source registered its engines, or in an attempt that started before: while no
        trainer ran, its agent could only reach the engines of the run that stopped (a call in
        flight to them fails when the proxy gives up on it, which may be after this source
        registered), so the failure says nothing of the policy."""
        pending = self.pending[rid]
        return (
            pending.restored
            and self.serving_since is not None
            and any(_before(moment, self.serving_since) for moment in (failed_at, pending.running_since))
        )

    # -- finishing ----------------------------------------------------------------------------

    def _events(self, rid: str, *, for_hooks: bool) -> list[dict[str, Any]]:
        """The rollout's events: in full when ``agl_on_succeeded`` hooks will read them, else only
        the fields the events parser reads."""
        hooks_read = for_hooks and bool(self.plugins.implementations("agl_on_succeeded"))
        return self.client.get_events(rid, only_parsed_fields=not hooks_read)

    def _read_terminal(self, rid: str, state: str) -> tuple[list[dict[str, Any]], str | None, Any] | GatewayError:
        """A terminal rollout's events and, when it failed, its error message and when it failed."""
        try:
            events = self._events(rid, for_hooks=state == "succeeded")
            status = self.client.get_rollout(rid)["rollout"]["status"] if state == "failed" else {}
        except GatewayError as exc:
            return exc
        return events, status.get("error_message"), status.get("updated_at")

    def _reads(self, ready: list[tuple[str, str]]) -> Iterator[tuple[str, str, Any]]:
        """``(rid, state, read)`` for each of ``ready`` in order, read concurrently with at most
        ``READ_WORKERS`` reads ahead of the one being consumed, so few decoded bodies are held."""
        queued = iter(ready)
        ahead = deque(
            (rid, state, self._pool.submit(self._read_terminal, rid, state))
            for rid, state in islice(queued, READ_WORKERS)
        )
        while ahead:
            rid, state, future = ahead.popleft()
            if (following := next(queued, None)) is not None:
                ahead.append((*following, self._pool.submit(self._read_terminal, *following)))
            yield rid, state, future.result()

    def _finish_terminal(self) -> int:
        """Read the rollouts the cursor reported (concurrently), run their hooks in order, delete them.

        A read that fails stays in ``self.terminal`` and is retried at the next poll; a 404 means the
        gateway lost the rollout."""
        ready = [(rid, state) for rid, state in self.terminal.items() if rid in self.pending]
        finished = []
        for rid, state, read in self._reads(ready):
            if isinstance(read, GatewayError):
                if read.not_found:
                    self._handle_lost([rid])
                elif not read.transient:
                    raise read
                else:
                    self.counts["training/gateway/n_event_read_errors"] += 1
                continue
            events, error, failed_at = read
            finished.append(rid)
            if state == "failed" and self._failed_unserved(rid, failed_at) and self._reenqueue(rid):
                self.counts["training/async/n_resumed_failed_unserved"] += 1
                continue
            self._finish(rid, state, events, error)
        list(self._pool.map(self._delete, finished))
        return len(finished)

    def _finish(
        self, rid: str, state: str, events: list[dict[str, Any]], error: str | None, *, held: bool = True
    ) -> None:
        """Finish a terminal rollout; ``held`` is false when the gateway no longer holds it (lost, or
        timed out and about to be deleted), so what its hooks write cannot be stored and is counted."""
        pending = self.pending[rid]
        if held and (last := last_event_time(events)) is not None:
            self._pickups.append(max(0.0, time.time() - last))
        rollout = finish_rollout(
            pending.request,
            events,
            state=state,
            error=error,
            queued_at=pending.queued_at,
            attempt_id=None,
            reward_fillna_value=self.reward_fillna_value,
            plugins=self.plugins,
            store=(lambda writer: self._flush(rid, writer, len(events))) if held else self._unflushed,
            # A failed rollout is not read again: the failed-rollout policy skips it or fills its reward.
            reread=(lambda: self._reread(rid)) if held and state == "succeeded" else None,
            counts=self.counts,
        )
        self._done(rid, rollout)

    def _reread(self, rid: str) -> list[dict[str, Any]] | None:
        try:
            return self.client.get_events(rid)
        except GatewayError as exc:
            self.counts["training/hooks/n_reread_failures"] += 1
            logger.warning("could not re-read events of %s after its hooks wrote some: %s", rid, exc)
            return None

    def _unflushed(self, writer: EventWriter) -> int:
        if dropped := writer.discard():
            self.counts["training/hooks/n_unflushed_events"] += dropped
        return 0

    def _fail(self, rid: str, error: str, *, read_events: bool) -> None:
        events: list[dict[str, Any]] = []
        if read_events:
            try:
                events = self._events(rid, for_hooks=False)
            except GatewayError:
                self.counts["training/gateway/n_event_read_errors"] += 1
        self._finish(rid, "failed", events, error, held=False)

    def _done(self, rid: str, rollout: CompletedRollout) -> None:
        del self.pending[rid]
        self.terminal.pop(rid, None)
        self.counts[f"training/rollouts/n_{rollout.state}"] += 1
        kept, counts = apply_failed_policy([rollout], self.failed_rollout_policy, self.reward_fillna_value)
        self.counts.update(counts)
        group = self.groups[rollout.group_id]
        group.done[rollout.rollout_id] = kept[0] if kept else None
        if kept and self.on_rollout_done is not None:
            self.on_rollout_done(kept[0])
        if group.complete:
            group.completed_at = time.monotonic()

    def _delete(self, rid: str) -> None:
        try:
            self.client.delete_rollout(rid)
        except GatewayError as exc:
            self.counts["training/gateway/n_delete_errors"] += 1
            logger.warning("could not delete rollout %s: %s", rid, exc)

    def _flush(self, rid: str, writer: EventWriter, n_events: int) -> int:
        """Append what the hooks wrote after the rollout's ``n_events`` events; return how many were sent.

        The client retries each event as its retry policy allows and, after an ambiguous failure,
        reads the events back before re-sending, so nothing is appended twice. An event that still
        fails is dropped with those after it, and counted."""
        total, position = len(writer.pending), n_events

        def post(event: PendingEvent) -> None:
            nonlocal position
            self.client.append_event(
                event.rollout_id, event.attempt_id, event.event_type, event.data, position=position
            )
            position += 1

        try:
            return writer.flush(post)
        except GatewayError as exc:
            unflushed = writer.discard()
            self.counts["training/hooks/n_unflushed_events"] += unflushed
            logger.warning("dropping %d hook events of %s: %s", unflushed, rid, exc)
            return total - unflushed

    # -- the RolloutSource interface ----------------------------------------------------------

    def collect(self, samples: Sequence[Mapping[str, Any]], *, step: int, is_train: bool) -> RolloutBatch:
        groups = self._enqueue(samples, step=step, is_train=is_train)
        self._wait(lambda: all(g.complete for g in groups))
        return self._batch(groups)

    def _batch(self, groups: list[Group], extra: Mapping[str, float] | None = None) -> RolloutBatch:
        rollouts = []
        for group in groups:
            rollouts.extend(group.rollouts())
            del self.groups[group.group_id]
        metrics = self.pop_counts()
        metrics.update(rollout_timing_metrics(rollouts))
        metrics.update(self.plugins.pop_metrics())
        metrics["training/gateway/poll_interval_s"] = self.poll_interval
        metrics.update(extra or {})
        return RolloutBatch(rollouts, metrics)

    def pop_counts(self) -> dict[str, float]:
        """What the source counted since the last call (rollouts by state, retries, restarts, hook
        events...) and the HTTP requests it sent meanwhile (``training/gateway/n_http_requests``)."""
        metrics = {k: float(v) for k, v in self.counts.items()}
        finished = self.counts["training/rollouts/n_succeeded"] + self.counts["training/rollouts/n_failed"]
        self.counts.clear()
        now = time.monotonic()
        metrics.update(source_metrics(finished, now - self._reported_at, self._pickups))
        self._reported_at, self._pickups = now, []
        sent = Counter(self.client.requests_sent)
        sent.subtract(self._requests_at_last_report)
        self._requests_at_last_report = Counter(self.client.requests_sent)
        metrics["training/gateway/n_http_requests"] = float(sum(sent.values()))
        return metrics

    # -- streaming: groups handed over as they finish -------------------------------------------

    def submit(
        self,
        samples: Sequence[Mapping[str, Any]],
        *,
        step: int,
        is_train: bool,
        group_ids: Sequence[str] | None = None,
    ) -> list[str]:
        """Create the rollouts of ``samples`` (one group each, ``group_ids`` when given) without
        waiting for them; their group ids. :meth:`finished_groups` hands each group over once done."""
        return [g.group_id for g in self._enqueue(samples, step=step, is_train=is_train, group_ids=group_ids)]

    def n_pending(self) -> int:
        """Rollouts created and not yet terminal (streaming)."""
        return len(self.pending)

    def finished_groups(self) -> list[FinishedGroup]:
        """Poll the gateway once; the submitted groups that finished since the last call, in the order
        they finished (possibly none). :attr:`poll_interval` says how long to wait before the next call."""
        progressed = self._poll_once()
        low, high = self.gateway.poll_interval_min_seconds, self.gateway.poll_interval_max_seconds
        self.poll_interval = low if progressed else min(high, self.poll_interval * 1.5)
        done = sorted((g for g in self.groups.values() if g.complete), key=lambda g: g.completed_at or 0.0)
        for group in done:
            del self.groups[group.group_id]
        return [FinishedGroup(g.group_id, g.step, g.is_train, g.size, g.rollouts()) for g in done]

    def before_weight_update(self) -> dict[str, float]:
        return {}

    def _register(self, endpoints: list[str], version: int) -> None:
        if not self.model_name:
            raise ConfigError("actor_rollout_ref.model.path", "needed to register models with the gateway")
        if self.serving_since is None:
            self._clear_previous_pause()
        previous = self.registered
        if previous is None or not set(previous[0]) <= set(endpoints):
            # stale endpoints (a previous run's too: its engines are gone); the gateway only clears all at once
            self.client.delete_models()
        self.client.register_models(self.model_name, endpoints, version)
        self.registered = (list(endpoints), int(version))
        if self.serving_since is None:
            self.serving_since = time.time()

    def _clear_previous_pause(self) -> None:
        """Resume the gateway's proxy if an earlier run left it paused. An async run pauses it around
        each weight update; one that ended inside an update (killed, or a Ray node lost) leaves it
        paused, and every model call of this run's agents would be refused (429) until this run's
        own first update resumed it: its first step's rollouts all failed. Counted in
        ``training/gateway/n_pauses_cleared``."""
        try:
            paused = bool(self.client.proxy_state().get("paused"))
        except GatewayError as exc:
            if not exc.not_found:
                raise
            return  # a gateway without the proxy's pause routes cannot have been paused
        if paused:
            logger.warning("the gateway's proxy was left paused by an earlier run; resuming it")
            self.client.resume()
            self.counts["training/gateway/n_pauses_cleared"] += 1

    def after_weight_update(self, endpoints: Sequence[str], version: int) -> None:
        """Register ``endpoints`` with ``version`` (upserted, so unchanged endpoints are never absent)."""
        self._register(list(endpoints), version)

    def close(self) -> None:
        """Delete every rollout still pending (so no controller keeps running it) and close the client."""
        for rid in list(self.pending):
            self._delete(rid)
        self.pending.clear()
        self._pool.shutdown()
        self.client.close()


def _before(moment: Any, since: float) -> bool:
    """Whether ``moment`` (a gateway timestamp, possibly absent) is a number before ``since``."""
    return isinstance(moment, (int, float)) and not isinstance(moment, bool) and moment < since
