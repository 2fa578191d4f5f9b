"""How the plugin manager calls hook implementations: one at a time, in plugin order, each bounded in time.

agl calls each implementation of its registry and lifecycle hooks on its own (not through pluggy's
hook caller), so one plugin's failure cannot stop the others. Lifecycle calls run in a fresh daemon
thread (with the caller's context variables) and the caller waits at most ``timeout`` seconds.
Python cannot stop a thread: a call that overruns is abandoned, runs on in the background with its
result ignored, and being a daemon thread does not keep the process alive at exit.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pluggy

__all__ = ["HookTimeout", "call_bounded", "in_plugin_order", "wrapper_impls"]


class HookTimeout(Exception):
    """A hook call did not return within its time limit and was abandoned."""


def call_bounded(function: Callable[..., Any], args: Sequence[Any], timeout: float, thread_name: str) -> Any:
    """``function(*args)``, or :class:`HookTimeout` after ``timeout`` seconds; what it raises is raised here."""
    outcome: dict[str, Any] = {}
    context = contextvars.copy_context()

    def run() -> None:
        try:
            outcome["result"] = context.run(function, *args)
        except BaseException as exc:  # handed to the waiting thread, which raises it
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=thread_name, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise HookTimeout(f"did not return within {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


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
