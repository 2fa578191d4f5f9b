"""How lifecycle hooks are called: bounded in time, isolated, in plugin order; pluggy wrappers refused."""

from __future__ import annotations

import threading

import attrs
import pytest

from agl_core import hookimpl
from agl_core.config import ConfigError, load_config
from agl_core.data import CompletedRollout, RolloutRequest
from agl_core.plugins import PluginError, PluginManager
from agl_core.plugins.event_writer import EventWriter
from tests.helpers.waiting import wait_until

FOREVER = threading.Event()  # never set: waiting on it blocks for good
HANG_LIMIT_S = 1.0  # the limit where a hook hangs: long beside a quick hook's time, even on a loaded machine


def manager(*plugins, timeout=60.0):
    pm = PluginManager(load_entrypoints=False, builtins={}, hook_timeout_seconds=timeout)
    for i, plugin in enumerate(plugins):
        pm.register(plugin, name=f"p{i}")
    return pm


class Hangs:
    @hookimpl
    def agl_on_startup(self):
        FOREVER.wait()

    @hookimpl
    def agl_on_enqueue(self, request):
        FOREVER.wait()

    @hookimpl
    def agl_on_succeeded(self, rollout, writer):
        writer.add_event(rollout.rollout_id, "0", "half-written", {})
        FOREVER.wait()

    @hookimpl
    def agl_on_failed(self, rollout):
        FOREVER.wait()


class Tags:
    def __init__(self):
        self.calls = []

    @hookimpl
    def agl_on_startup(self):
        self.calls.append("startup")

    @hookimpl
    def agl_on_enqueue(self, request):
        self.calls.append("enqueue")
        return attrs.evolve(request, metadata={"tagged": True})

    @hookimpl
    def agl_on_succeeded(self, rollout, writer):
        self.calls.append("succeeded")
        writer.add_event(rollout.rollout_id, "0", "judge", {"score": 1})

    @hookimpl
    def agl_on_failed(self, rollout):
        self.calls.append("failed")


def test_a_hook_that_never_returns_is_abandoned_and_training_goes_on(caplog):
    tags = Tags()
    pm = manager(Hangs(), tags, timeout=HANG_LIMIT_S)
    pm.on_startup(config={})
    request = pm.enqueue(RolloutRequest(rollout_id="r1", group_id="g", input={}))
    writer = EventWriter()
    pm.on_succeeded(CompletedRollout(rollout_id="r1", group_id="g", state="succeeded"), {}, writer)
    pm.on_failed(CompletedRollout(rollout_id="r2", group_id="g", state="failed"), EventWriter())

    assert tags.calls == ["startup", "enqueue", "succeeded", "failed"], "the plugin after the hung one still ran"
    assert request.metadata["tagged"] is True
    assert [e.event_type for e in writer.pending] == ["judge"], "what the abandoned hook wrote is discarded"
    metrics = pm.pop_metrics()
    assert metrics["training/n_hook_timeouts"] == metrics["training/n_hook_failures"] == 4
    for hook in ("agl_on_startup", "agl_on_enqueue", "agl_on_succeeded", "agl_on_failed"):
        assert metrics[f"training/n_hook_timeouts/{hook}"] == 1
    assert metrics["training/hooks/n_discarded_events"] == 1
    assert f"plugin 'p0' did not return within {HANG_LIMIT_S:g} s" in caplog.text
    assert "agentlightning.hook_timeout_seconds" in caplog.text
    assert pm.pop_metrics()["training/n_hook_timeouts"] == 0, "counts are per step"


def test_a_hung_hook_is_skipped_until_its_abandoned_call_returns():
    """One time limit per hang, not one per rollout, and one thread held by it, not one per call."""
    release = threading.Event()
    started = []

    class HangsUntilReleased:
        @hookimpl
        def agl_on_enqueue(self, request):
            started.append(request.rollout_id)
            if len(started) == 1:
                release.wait()

    pm = manager(HangsUntilReleased(), timeout=HANG_LIMIT_S)
    for rid in ("r1", "r2", "r3"):
        pm.enqueue(RolloutRequest(rollout_id=rid, group_id="g", input={}))
    assert started == ["r1"], "no call while the abandoned one still runs"
    metrics = pm.pop_metrics()
    assert (
        metrics["training/n_hook_timeouts"],
        metrics["training/n_hook_skipped"],
        metrics["training/n_hook_failures"],
    ) == (1, 2, 3)
    release.set()
    wait_until(lambda: len(pm.calls.threads.idle) == 1, "the released call returning its thread")
    pm.enqueue(RolloutRequest(rollout_id="r4", group_id="g", input={}))
    assert started == ["r1", "r4"], "calls resume once it returned"
    assert pm.pop_metrics()["training/n_hook_failures"] == 0
    assert pm.calls.threads.started == 1, "one thread ran every call, the abandoned one's included"


def test_lifecycle_calls_reuse_their_threads():
    """A thread per call made at once, not one per call: a rollout's hooks cost no thread start."""
    tags = Tags()
    pm = manager(tags, Tags())
    for i in range(50):
        pm.enqueue(RolloutRequest(rollout_id=f"r{i}", group_id="g", input={}))
        pm.on_succeeded(CompletedRollout(rollout_id=f"r{i}", group_id="g", state="succeeded"), {}, EventWriter())
    assert tags.calls.count("enqueue") == tags.calls.count("succeeded") == 50
    assert pm.calls.threads.started == 1


def test_the_limit_comes_from_the_config():
    cfg = load_config(overrides=["agentlightning.hook_timeout_seconds=0.5"])
    assert PluginManager.from_config(cfg, load_entrypoints=False, builtins={}).hook_timeout_seconds == 0.5
    assert PluginManager(load_entrypoints=False, builtins={}).hook_timeout_seconds == 60.0
    with pytest.raises(ConfigError, match="greater than 0") as info:
        load_config(overrides=["agentlightning.hook_timeout_seconds=0"])
    assert info.value.key == "agentlightning.hook_timeout_seconds"


def test_a_raising_hook_is_still_isolated_and_its_error_kept():
    class Raises:
        @hookimpl
        def agl_on_startup(self):
            raise KeyError("missing")

    tags = Tags()
    pm = manager(Raises(), tags)
    pm.on_startup(config={})
    assert tags.calls == ["startup"]
    metrics = pm.pop_metrics()
    assert metrics["training/n_hook_failures"] == 1 and metrics["training/n_hook_timeouts"] == 0


def test_order_is_registration_order_with_tryfirst_and_trylast():
    order = []

    def plugin(label, **opts):
        class P:
            @hookimpl(**opts)
            def agl_on_startup(self):
                order.append(label)

        return P()

    pm = manager(plugin("a"), plugin("last", trylast=True), plugin("b"), plugin("first", tryfirst=True))
    pm.on_startup(config={})
    assert order == ["first", "a", "b", "last"]


@pytest.mark.parametrize(
    "opts, kind", [({"wrapper": True}, "wrapper=True"), ({"hookwrapper": True}, "hookwrapper=True")]
)
@pytest.mark.parametrize("hook", ["agl_on_enqueue", "agl_on_succeeded", "agl_register_aggregators"])
def test_hook_wrappers_are_refused_naming_plugin_and_hook(opts, kind, hook):
    args = {"agl_on_enqueue": "request", "agl_on_succeeded": "rollout", "agl_register_aggregators": "register"}[hook]
    namespace: dict = {}
    exec(f"def {hook}(self, {args}):\n    yield\n", namespace)
    plugin = type("Wrapping", (), {hook: hookimpl(**opts)(namespace[hook])})()
    pm = PluginManager(load_entrypoints=False, builtins={})
    with pytest.raises(PluginError, match=rf"plugin 'wrapping': {hook} is a hook wrapper \({kind}\)"):
        pm.register(plugin, name="wrapping")
    assert pm.get_plugin("wrapping") is None, "a refused plugin is not left half-registered"


def test_a_wrapper_on_the_hook_pluggy_calls_works_as_pluggy_documents(tmp_path):
    seen = []

    class AroundLoading:
        @hookimpl(wrapper=True)
        def agl_load_hook_file(self, path):
            seen.append(path.name)
            return (yield)

    hook_file = tmp_path / "hooks.py"
    hook_file.write_text("from agl_core import hookimpl\n\n@hookimpl\ndef agl_on_startup(config):\n    pass\n")
    pm = PluginManager(load_entrypoints=False, builtins={})  # agl's own hook-file loader still loads
    pm.register(AroundLoading(), name="around")
    assert pm.load_hook_files([hook_file]) == [f"hookfile:{hook_file.resolve()}"]
    assert seen == ["hooks.py"]


class RaisesByKind:
    """on_startup raises ValueError, then KeyError, then ValueError again."""

    def __init__(self):
        self.errors = [ValueError("bad value"), KeyError("missing"), ValueError("bad value")]

    @hookimpl
    def agl_on_startup(self):
        raise self.errors.pop(0)


def _failure_records(caplog):
    return [r for r in caplog.records if r.name == "agl_core.plugins.calls" and "failed" in r.getMessage()]


def test_each_hook_failure_is_one_line_with_the_traceback_once_per_kind(caplog, monkeypatch):
    monkeypatch.delenv("AGL_HOOK_TRACEBACKS", raising=False)
    pm = manager(RaisesByKind())
    for _ in range(3):
        pm.on_startup(config={})
    records = _failure_records(caplog)
    assert len(records) == 3
    assert all("\n" not in r.getMessage() and "plugin 'p0'" in r.getMessage() for r in records)
    assert ["ValueError: bad value" in records[0].getMessage(), "KeyError: 'missing'" in records[1].getMessage()] == [
        True,
        True,
    ]
    # the first ValueError and the first KeyError carry their traceback; the second ValueError does not
    assert [r.exc_info is not None for r in records] == [True, True, False]
    assert "AGL_HOOK_TRACEBACKS=1" in records[2].getMessage()
    assert pm.pop_metrics()["training/n_hook_failures"] == 3


def test_every_traceback_is_logged_under_the_debug_flag(caplog, monkeypatch):
    monkeypatch.setenv("AGL_HOOK_TRACEBACKS", "1")
    pm = manager(RaisesByKind())
    for _ in range(3):
        pm.on_startup(config={})
    assert [r.exc_info is not None for r in _failure_records(caplog)] == [True, True, True]
