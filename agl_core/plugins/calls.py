"""How the plugin manager calls hook implementations: one at a time, in plugin order, isolated, bounded in time.

agl calls each implementation of its registry and lifecycle hooks on its own (not through pluggy's
hook caller): a lifecycle hook's failure cannot stop the other plugins' (this module), while a
registry hook's failure stops the run with a ``PluginError`` naming its plugin (a plugin whose
entries are missing would change what runs; ``PluginManager``). It reads the implementation from
pluggy's public :class:`pluggy.HookImpl` (``function``, ``argnames``, ``plugin_name``, ``tryfirst``,
``trylast``). :class:`HookCalls` runs each lifecycle call on one of a few daemon threads it keeps
(:class:`HookThreads`, with the caller's context variables) and waits at most its time limit: a
thread is started only when every kept one is busy, so a run starts as many as calls it ever made at
once, not one per call. Python cannot stop a thread: a call that overruns is abandoned, runs on in
the background with its result ignored (its thread is taken back once it returns), and a daemon
thread does not keep the process alive at exit. That plugin's hook is not called again until the
abandoned call has returned (the calls in between are skipped and counted), so a hook that hangs
every time costs one time limit, not one per rollout, and holds one thread, not one per call.

A failing call is logged on one line (plugin, hook, subject, exception). Its traceback is logged with
the first failure of each (plugin, hook, exception type) only, so a hook that fails on every rollout
does not drown the log; ``AGL_HOOK_TRACEBACKS=1`` logs the traceback of every failure.
"""

from __future__ import annotations

import contextvars
import logging
import os
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pluggy

from agl_core.errors import AglError
from agl_core.plugins.event_writer import EventWriter

__all__ = ["HookCalls", "HookThreads", "HookTimeout", "in_plugin_order", "wrapper_impls"]

logger = logging.getLogger(__name__)

HOOK_FAILURES_METRIC = "training/n_hook_failures"
# Lifecycle calls abandoned after the time limit (each also counted as a failure).
HOOK_TIMEOUTS_METRIC = "training/n_hook_timeouts"
# Calls not made (each also counted as a failure): the plugin's abandoned call of the hook still runs.
HOOK_SKIPS_METRIC = "training/n_hook_skipped"
# Events a hook queued before it raised or overran: discarded (a failing hook writes nothing), and counted.
DISCARDED_HOOK_EVENTS_METRIC = "training/hooks/n_discarded_events"
# Changes a hook made to fields it may not change (a request's ids and place): undone, warned once, counted.
HOOK_CHANGES_IGNORED_METRIC = "training/n_hook_changes_ignored"
# Set to a true value to log the traceback of every hook failure, not only the first of each kind.
TRACEBACKS_ENV = "AGL_HOOK_TRACEBACKS"


class HookTimeout(AglError):
    """A hook call did not return within its time limit and was abandoned; ``returned`` is set once
    it has (its thread runs it until then)."""

    __module__ = "agl_core"

    def __init__(self, message: str, returned: threading.Event):
        super().__init__(message)
        self.returned = returned


class HookThreads:
    """The daemon threads that run lifecycle hook calls: an idle one takes the next call, and a new
    one is started only when every one is busy (calls made at once from several threads, or calls
    abandoned past their time limit)."""

    def __init__(self, name: str = "agl-hook"):
        self.name = name
        self.started = 0  # threads started so far
        self.idle: list[queue.SimpleQueue] = []  # each idle thread's inbox
        self._lock = threading.Lock()

    def call(self, function: Callable[..., Any], args: Sequence[Any], timeout: float) -> Any:
        """``function(*args)`` on one of the threads, with the caller's context variables; what it
        returns or raises, or :class:`HookTimeout` after ``timeout`` seconds."""
        with self._lock:
            inbox = self.idle.pop() if self.idle else self._start()
        outcome: dict[str, Any] = {}
        returned = threading.Event()
        inbox.put((function, args, contextvars.copy_context(), outcome, returned))
        if not returned.wait(timeout):
            raise HookTimeout(f"did not return within {timeout:g} s", returned)
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("result")

    def _start(self) -> queue.SimpleQueue:
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.started += 1
        threading.Thread(target=self._serve, args=(inbox,), name=f"{self.name}-{self.started}", daemon=True).start()
        return inbox

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            function, args, context, outcome, returned = inbox.get()
            try:
                outcome["result"] = context.run(function, *args)
            except BaseException as exc:  # handed to the waiting thread, which raises it
                outcome["error"] = exc
            with self._lock:
                self.idle.append(inbox)
            returned.set()


class HookCalls:
    """Calls lifecycle hook implementations: isolated, bounded by ``timeout`` seconds, failures counted."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.failures: Counter[str] = Counter()
        self.timeouts: Counter[str] = Counter()
        self.skips: Counter[str] = Counter()
        self.discarded_events = 0
        self.ignored_changes: Counter[str] = Counter()
        self._warned_changes: set[tuple[str, str, str]] = set()  # (plugin, hook, field) warned about
        self._abandoned: dict[tuple[str, str], threading.Event] = {}  # (plugin, hook) -> set once the call returns
        self.threads = HookThreads()
        self._traced: set[tuple[str, str, type[BaseException]]] = set()  # (plugin, hook, exception type) logged in full

    def call(self, impl: Any, hook_name: str, subject: str, kwargs: Mapping[str, Any]) -> tuple[bool, Any]:
        """``(True, result)`` of one implementation, or ``(False, None)`` when it raised, overran the
        time limit or was skipped (logged with its plugin's name and counted)."""
        key = (impl.plugin_name, hook_name)
        if key in self._abandoned:
            if not self._abandoned[key].is_set():
                self.failures[hook_name] += 1
                self.skips[hook_name] += 1
                return False, None
            del self._abandoned[key]
        try:
            args = [kwargs[arg] for arg in impl.argnames]
            return True, self.threads.call(impl.function, args, self.timeout)
        except HookTimeout as exc:
            self._abandoned[key] = exc.returned
            self.failures[hook_name] += 1
            self.timeouts[hook_name] += 1
            logger.error(
                "hook %s of plugin %r did not return within %g s (%s): abandoned and counted as a failure; its next "
                "calls are skipped (and counted) until it returns; training continues "
                "(agentlightning.hook_timeout_seconds sets the limit)",
                hook_name,
                impl.plugin_name,
                self.timeout,
                subject,
            )
        except Exception as exc:
            self.record_failure(hook_name, impl.plugin_name, subject, exc)
        return False, None

    def call_each(
        self, impls: Sequence[Any], hook_name: str, subject: str, kwargs: Mapping[str, Any]
    ) -> list[tuple[str, Any]]:
        """Call every implementation in order; return ``(plugin, result)`` of those that returned.

        Each call gets a writer of its own that starts with what the calls before it wrote (a later
        hook sees earlier hooks' events); what a call that returned added is passed on to
        ``kwargs["writer"]``, what a failed or abandoned one added is discarded and counted."""
        results = []
        writer = kwargs.get("writer")
        for impl in impls:
            own = EventWriter()
            mark = 0
            if writer is not None:
                for event in writer.pending:
                    own.add_event(event.rollout_id, event.attempt_id, event.event_type, event.data)
                mark = len(writer.pending)
            ok, result = self.call(
                impl, hook_name, subject, {**kwargs, "writer": own} if writer is not None else kwargs
            )
            if not ok:
                self.discarded_events += own.discard(keep=mark)
                continue
            for event in own.pending[mark:]:
                writer.add_event(event.rollout_id, event.attempt_id, event.event_type, event.data)
            results.append((impl.plugin_name, result))
        return results

    def record_failure(self, hook_name: str, plugin_name: str, subject: str, exc: BaseException) -> None:
        """Count one failure of ``plugin_name``'s ``hook_name`` and log it on one line, with the
        traceback the first time this plugin's hook fails with this exception type."""
        self.failures[hook_name] += 1
        kind = (plugin_name, hook_name, type(exc))
        first = kind not in self._traced
        self._traced.add(kind)
        logger.error(
            "hook %s of plugin %r failed (%s): %s: %s; training continues%s",
            hook_name,
            plugin_name,
            subject,
            type(exc).__name__,
            exc,
            "" if first else f" (traceback shown at its first failure; {TRACEBACKS_ENV}=1 shows every one)",
            exc_info=exc if first or env_flag(TRACEBACKS_ENV) else None,
        )

    def record_ignored_changes(self, hook_name: str, plugin_name: str, subject: str, fields: Sequence[str]) -> None:
        """Count a call of ``plugin_name``'s ``hook_name`` whose changes to ``fields`` were undone (the
        rest of its result is kept), warning once per plugin, hook and field."""
        self.ignored_changes[hook_name] += 1
        for field in fields:
            if (plugin_name, hook_name, field) not in self._warned_changes:
                self._warned_changes.add((plugin_name, hook_name, field))
                logger.warning(
                    "hook %s of plugin %r changed %s (%s), which a hook may not change: the change is undone, "
                    "the rest of the result kept; counted in %s, warned once",
                    hook_name,
                    plugin_name,
                    field,
                    subject,
                    HOOK_CHANGES_IGNORED_METRIC,
                )

    def pop_metrics(self) -> dict[str, float]:
        """Failure, timeout and skip counts since the last call (``training/n_hook_failures[/hook]``,
        ``training/n_hook_timeouts[/hook]``, ``training/n_hook_skipped[/hook]``), the calls whose
        changes to fixed fields were undone (``training/n_hook_changes_ignored[/hook]``) and the number
        of events discarded because the hook that queued them raised or overran."""
        metrics: dict[str, float] = {DISCARDED_HOOK_EVENTS_METRIC: float(self.discarded_events)}
        for name, counts in (
            (HOOK_FAILURES_METRIC, self.failures),
            (HOOK_TIMEOUTS_METRIC, self.timeouts),
            (HOOK_SKIPS_METRIC, self.skips),
            (HOOK_CHANGES_IGNORED_METRIC, self.ignored_changes),
        ):
            metrics[name] = float(sum(counts.values()))
            for hook_name, count in counts.items():
                metrics[f"{name}/{hook_name}"] = float(count)
            counts.clear()
        self.discarded_events = 0
        return metrics


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to a true value (1, true, yes, on)."""
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def in_plugin_order(impls: Sequence[Any]) -> list[Any]:
    """Registration order, ``tryfirst`` implementations first and ``trylast`` ones last.

    pluggy keeps implementations with the last registered at the end and calls from the end; agl's
    lifecycle hooks chain in discovery order instead (built-ins, then entry points, then hook files).
    """
    first = [i for i in impls if i.tryfirst]
    last = [i for i in impls if i.trylast]
    middle = [i for i in impls if not i.tryfirst and not i.trylast]
    return first + middle + last


def wrapper_impls(pm: pluggy.PluginManager, plugin: Any, skip: Sequence[str] = ()) -> Iterator[tuple[str, str]]:
    """``(hook name, "wrapper=True" | "hookwrapper=True")`` for each hook ``plugin`` implements as a
    pluggy wrapper, except the hooks in ``skip``. Called one implementation at a time, a wrapper would
    wrap nothing."""
    for caller in pm.get_hookcallers(plugin) or ():
        if caller.name in skip:
            continue
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin and (impl.wrapper or impl.hookwrapper):
                yield caller.name, "wrapper=True" if impl.wrapper else "hookwrapper=True"
