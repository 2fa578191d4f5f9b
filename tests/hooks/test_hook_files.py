"""Hook files load as plugins, fire in order, and every bad file gets a precise error."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from agl_core import hookimpl
from agl_core.data import CompletedRollout, RolloutRequest
from agl_core.plugins import PluginError, PluginManager
from agl_core.plugins.event_writer import EventWriter
from agl_hooks import rollout_hooks, schemas
from agl_hooks.loader import HookFileError, load_hook_file

AGL_V1_HOOK_FILE = """
from agentlightning.hooks import RolloutHooks

CALLS = []


class TagRollouts(RolloutHooks):
    def on_startup(self, store=None):
        CALLS.append("startup")

    def on_enqueue(self, request):
        CALLS.append("v1-enqueue")
        metadata = dict(request.metadata or {})
        metadata["order"] = metadata.get("order", "") + "v1;"
        return request.model_copy(update={"metadata": metadata})

    def on_succeeded(self, rollout, events, store):
        CALLS.append(("succeeded", rollout.rollout_id, rollout.status.state, sorted(events)))
        n_calls = sum(1 for e in events[rollout.status.last_attempt_id] if e.event_type == "model_request")
        store.add_event(rollout.rollout_id, rollout.status.last_attempt_id, "reward", {"value": float(n_calls)})

    def on_failed(self, rollout, store):
        CALLS.append(("failed", rollout.rollout_id, rollout.status.error_message))
"""

MODULE_HOOK_FILE = """
import attrs
from agl_core import hookimpl

CALLS = []


@hookimpl
def agl_on_enqueue(request):
    CALLS.append("module-enqueue")
    return attrs.evolve(request, metadata={**request.metadata, "order": request.metadata.get("order", "") + "module;"})


@hookimpl
def agl_on_succeeded(rollout, events, writer):
    CALLS.append(("module-succeeded", rollout.rollout_id, sorted(events)))
    writer.add_event(rollout.rollout_id, rollout.attempt_id, "judge", {"score": 1})


@hookimpl
def agl_on_failed(rollout, writer):
    CALLS.append(("module-failed", rollout.rollout_id))
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def request(rollout_id="r1"):
    return RolloutRequest(rollout_id=rollout_id, group_id="g1", input={"q": 1})


def manager_with(*paths):
    manager = PluginManager(load_entrypoints=False, builtins={})
    manager.load_hook_files(paths)
    return manager


def module_of(manager, path):
    """The executed module behind a loaded hook file (to read what its hooks recorded)."""
    plugin = manager.get_plugin(f"hookfile:{path.resolve()}")
    return sys.modules[type(plugin.hooks).__module__] if hasattr(plugin, "hooks") else plugin


def test_v1_and_module_hook_files_load_and_fire_in_order(tmp_path):
    v1 = write(tmp_path, "v1_hooks.py", AGL_V1_HOOK_FILE)
    mod = write(tmp_path, "mod_hooks.py", MODULE_HOOK_FILE)
    manager = manager_with(v1, mod)
    v1_calls, mod_calls = module_of(manager, v1).CALLS, module_of(manager, mod).CALLS

    manager.on_startup(config={})
    out = manager.enqueue(request())
    assert out.metadata["order"] == "v1;module;", "hooks chain in plugin (load) order"
    assert v1_calls[:2] == ["startup", "v1-enqueue"] and mod_calls == ["module-enqueue"]

    rollout = CompletedRollout(rollout_id="r1", group_id="g1", state="succeeded", attempt_id="a0")
    events = {
        "a0": [
            {"event_type": "model_request", "data": {}, "timestamp": 1.0},
            {"event_type": "reward", "data": {"value": 0.0}},
        ]
    }
    writer = EventWriter()
    manager.on_succeeded(rollout, events, writer)
    assert v1_calls[-1] == ("succeeded", "r1", "succeeded", ["a0"])
    assert mod_calls[-1] == ("module-succeeded", "r1", ["a0"])
    assert [(e.rollout_id, e.attempt_id, e.event_type, e.data) for e in writer.pending] == [
        ("r1", "a0", "reward", {"value": 1.0}),
        ("r1", "a0", "judge", {"score": 1}),
    ]
    sent = []
    assert writer.flush(sent.append) == 2 and not writer.pending and len(sent) == 2

    failed = CompletedRollout(rollout_id="r2", group_id="g1", state="failed", error="agent crashed")
    manager.on_failed(failed, EventWriter())
    assert v1_calls[-1] == ("failed", "r2", "agent crashed")
    assert mod_calls[-1] == ("module-failed", "r2")
    assert manager.pop_metrics()["training/n_hook_failures"] == 0


@pytest.fixture
def standins(monkeypatch):
    """agl's stand-ins for v1.0's models, as where Agent Lightning is not installed (in either environment)."""
    monkeypatch.setattr(rollout_hooks, "v1_models", lambda: schemas)


def test_agentlightning_alias_does_not_leak(tmp_path, standins):
    before = {
        name: sys.modules.get(name) for name in ("agentlightning", "agentlightning.hooks", "agentlightning.schemas")
    }
    manager_with(write(tmp_path, "v1_hooks.py", AGL_V1_HOOK_FILE))
    assert {name: sys.modules.get(name) for name in before} == before


def test_a_raising_hook_does_not_stop_the_others(tmp_path, caplog):
    boom = write(
        tmp_path,
        "boom.py",
        """
        from agl_core import hookimpl

        @hookimpl
        def agl_on_enqueue(request):
            raise RuntimeError("boom")
        """,
    )
    mod = write(tmp_path, "mod_hooks.py", MODULE_HOOK_FILE)
    manager = manager_with(boom, mod)
    out = manager.enqueue(request())
    assert out.metadata["order"] == "module;"
    metrics = manager.pop_metrics()
    assert metrics["training/n_hook_failures"] == 1
    assert metrics["training/n_hook_failures/agl_on_enqueue"] == 1
    assert f"hookfile:{boom.resolve()}" in caplog.text and "boom" in caplog.text


def test_a_raising_hook_writes_nothing_but_the_others_write(tmp_path):
    half = write(
        tmp_path,
        "half.py",
        """
        from agl_core import hookimpl

        @hookimpl
        def agl_on_failed(rollout, writer):
            writer.add_event(rollout.rollout_id, "0", "note", {"written": "before the crash"})
            raise RuntimeError("crash after writing")
        """,
    )
    mod = write(tmp_path, "mod_hooks.py", MODULE_HOOK_FILE)
    v1 = write(tmp_path, "v1_hooks.py", AGL_V1_HOOK_FILE)
    manager = manager_with(v1, half, mod)
    writer = EventWriter()
    writer.add_event("r0", "0", "earlier", {})
    manager.on_failed(CompletedRollout(rollout_id="r3", group_id="g", state="failed"), writer)
    assert [e.event_type for e in writer.pending] == ["earlier"]
    metrics = manager.pop_metrics()
    assert metrics["training/hooks/n_discarded_events"] == 1
    assert metrics["training/n_hook_failures/agl_on_failed"] == 1
    assert module_of(manager, mod).CALLS[-1] == ("module-failed", "r3"), "plugins after the failing one still run"


def test_enqueue_rewrite_may_not_change_ids_the_change_is_undone_warned_once_and_counted(tmp_path, caplog):
    bad = write(
        tmp_path,
        "bad.py",
        """
        import attrs
        from agl_core import hookimpl

        @hookimpl
        def agl_on_enqueue(request):
            return attrs.evolve(request, rollout_id="stolen-" + request.rollout_id, step=99, metadata={"kept": True})
        """,
    )
    manager = manager_with(bad)
    results = [manager.enqueue(request(f"r{i}")) for i in range(3)]
    assert [(r.rollout_id, r.step, dict(r.metadata)) for r in results] == [
        (f"r{i}", 0, {"kept": True}) for i in range(3)
    ]
    metrics = manager.pop_metrics()
    assert (
        metrics["training/n_hook_changes_ignored"] == 3
        and metrics["training/n_hook_changes_ignored/agl_on_enqueue"] == 3
    )
    assert metrics["training/n_hook_failures"] == 0
    warnings = [r.getMessage() for r in caplog.records if "which a hook may not change" in r.getMessage()]
    assert len(warnings) == 2 and "changed rollout_id" in warnings[0] and "changed step" in warnings[1]


def test_a_v1_hook_rewriting_rollout_id_is_undone_warned_once_and_counted(tmp_path, caplog):
    hooks = write(
        tmp_path,
        "v1_rename.py",
        """
        from agentlightning.hooks import RolloutHooks

        class Rename(RolloutHooks):
            def on_enqueue(self, request):
                request.rollout_id = "mine-" + request.rollout_id
                request.metadata = {"batch_idx": 7}
                return request
        """,
    )
    manager = manager_with(hooks)
    results = [manager.enqueue(request(f"r{i}")) for i in range(2)]
    assert [(r.rollout_id, r.metadata["batch_idx"]) for r in results] == [("r0", 7), ("r1", 7)]
    assert manager.pop_metrics()["training/n_hook_changes_ignored"] == 2
    assert sum("changed rollout_id" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    "name, text, message",
    [
        (
            "syntax.py",
            "X = 1\ndef broken(:\n    pass\n",
            r"failed to import: .*syntax\.py:2: SyntaxError: invalid syntax$",
        ),
        (
            "importerr.py",
            "import not_a_module_anywhere_xyz\n",
            r"failed to import:(.|\n)*importerr\.py(.|\n)*ModuleNotFoundError",
        ),
        ("empty.py", "X = 1\n", "no hooks found in hook file"),
        (
            "two.py",
            "from agl_hooks import RolloutHooks\nclass A(RolloutHooks): pass\nclass B(RolloutHooks): pass\n",
            r"several RolloutHooks subclasses \(A, B\)",
        ),
        (
            "typo_v1.py",
            "from agl_hooks import RolloutHooks\nclass A(RolloutHooks):\n"
            "    def on_succeded(self, rollout, events, store): pass\n",
            r"A\.on_succeded is not a hook; did you mean 'on_succeeded'",
        ),
        (
            "typo_mod.py",
            "from agl_core import hookimpl\n@hookimpl\ndef agl_on_enqeue(request): return None\n",
            r"unknown hook 'agl_on_enqeue'; did you mean 'agl_on_enqueue'",
        ),
        (
            "camel_v1.py",
            "from agl_hooks import RolloutHooks\nclass A(RolloutHooks):\n"
            "    def onSucceeded(self, rollout, events, store): pass\n",
            r"A\.onSucceeded is not a hook, so it would never be called; did you mean 'on_succeeded'",
        ),
        (
            "bare_v1.py",
            "from agl_hooks import RolloutHooks\nclass A(RolloutHooks):\n"
            "    def enqueue(self, request): return request\n",
            r"A\.enqueue is not a hook, so it would never be called; did you mean 'on_enqueue'",
        ),
        (
            "unprefixed_mod.py",
            "from agl_core import hookimpl\n@hookimpl\ndef agl_on_startup(config): pass\n"
            "def on_succeeded(rollout, writer): pass\n",
            r"function on_succeeded is not a hook, so it would never be called; did you mean 'agl_on_succeeded'",
        ),
        (
            "v1_name_at_module_level.py",
            "from agl_hooks import RolloutHooks\nclass A(RolloutHooks):\n"
            "    def on_failed(self, rollout, store): pass\n"
            "def onSucceeded(rollout, events, store): pass\n",
            r"function onSucceeded is not a hook, so it would never be called; did you mean 'agl_on_succeeded'",
        ),
        ("undecorated.py", "def agl_on_enqueue(request): return None\n", "must be decorated with @agl_core.hookimpl"),
        (
            "mixed.py",
            "from agl_core import hookimpl\nfrom agl_hooks import RolloutHooks\nclass A(RolloutHooks): pass\n"
            "@hookimpl\ndef agl_on_startup(config): pass\n",
            "mixes a RolloutHooks subclass",
        ),
    ],
)
def test_bad_hook_files_give_precise_errors(tmp_path, name, text, message):
    path = write(tmp_path, name, text)
    with pytest.raises(HookFileError, match=message) as info:
        load_hook_file(path)
    assert str(path.resolve()) in str(info.value)


def test_missing_hook_file(tmp_path):
    with pytest.raises(HookFileError, match="hook file not found: .*nope.py"):
        load_hook_file(tmp_path / "nope.py")


def test_hooks_from_config_accept_a_path_or_a_list(tmp_path):
    v1 = write(tmp_path, "v1_hooks.py", AGL_V1_HOOK_FILE)
    mod = write(tmp_path, "mod_hooks.py", MODULE_HOOK_FILE)
    one = PluginManager.from_config({"agentlightning": {"hooks": str(v1)}}, load_entrypoints=False, builtins={})
    both = PluginManager.from_config(
        {"agentlightning": {"hooks": [str(v1), str(mod)]}}, load_entrypoints=False, builtins={}
    )
    assert (
        one.get_plugin(f"hookfile:{v1.resolve()}") is not None and one.get_plugin(f"hookfile:{mod.resolve()}") is None
    )
    assert both.get_plugin(f"hookfile:{mod.resolve()}") is not None


class _JsonHookFiles:
    """A plugin that loads ``.json`` hook files and leaves other files to the next loader."""

    @hookimpl(tryfirst=True)
    def agl_load_hook_file(self, path):
        if path.suffix != ".json":
            return None
        return _StartupLogger(path.name)


class _StartupLogger:
    def __init__(self, label):
        self.label = label
        self.seen = []

    @hookimpl
    def agl_on_startup(self, config):
        self.seen.append(config)


def test_hook_file_loading_is_a_hook_another_plugin_can_implement(tmp_path):
    json_file = write(tmp_path, "hooks.json", "{}")
    py_file = write(tmp_path, "hooks.py", MODULE_HOOK_FILE)
    manager = PluginManager(load_entrypoints=False, builtins={})
    manager.register(_JsonHookFiles(), name="json-hook-files")
    names = manager.load_hook_files([json_file, py_file])
    assert names == [f"hookfile:{json_file.resolve()}", f"hookfile:{py_file.resolve()}"]
    logger = manager.get_plugin(names[0])
    assert isinstance(logger, _StartupLogger) and logger.label == "hooks.json"
    manager.on_startup({"x": 1})
    assert logger.seen == [{"x": 1}]
    # the .py file fell through to agl_hooks' loader (the 'hookfiles' entry point)
    assert manager.get_plugin(names[1]).__name__.startswith("agl_hookfile_hooks_")


def test_without_a_hook_file_loader_the_error_says_what_provides_it(tmp_path, monkeypatch):
    monkeypatch.setenv("AGL_BLOCKED_PLUGINS", "hookfiles")
    path = write(tmp_path, "hooks.py", MODULE_HOOK_FILE)
    manager = PluginManager(load_entrypoints=False, builtins={})
    with pytest.raises(PluginError, match=r"hook file .*hooks\.py: no plugin loads hook files \(agl_hooks provides"):
        manager.load_hook_files([path])


def test_registering_one_plugin_twice_names_both_registrations():
    manager = PluginManager(load_entrypoints=False, builtins={})
    plugin = _StartupLogger("once")
    manager.register(plugin, name="first")
    with pytest.raises(PluginError, match=r"already registered as 'first' \(code\); register each plugin once"):
        manager.register(plugin, name="second")


# A v1.0 hook file that reads and writes what v1.0's pydantic models offer, beyond the four methods.
V1_MODEL_ACCESS_HOOK_FILE = """
from agentlightning.hooks import RolloutHooks
from agentlightning.schemas import (
    DEFAULT_ATTEMPT_ID, TERMINAL_STATES, Rollout, RolloutConfig, RolloutCreate, RolloutMetadata, RolloutState,
)

SEEN = []


class Models(RolloutHooks):
    def on_enqueue(self, request: RolloutCreate) -> RolloutCreate:
        SEEN.append(("timeout", request.config.timeout_seconds, request.config["timeout_seconds"]))
        SEEN.append(("agent", request.config.local.agent_class, request.metadata.batch_idx))
        request.config.timeout_seconds = 90
        return request.model_copy(update={"metadata": RolloutMetadata(batch_idx=3, team="red")})

    def on_succeeded(self, rollout: Rollout, events, store) -> None:
        assert rollout.status.state == RolloutState.SUCCEEDED and rollout.status.state in TERMINAL_STATES
        SEEN.append(("succeeded", rollout.status.version, rollout.metadata.batch_idx, rollout.metadata["team"]))
        SEEN.append(("config", rollout.config.timeout_seconds, rollout.config.k8s.job_template, DEFAULT_ATTEMPT_ID))

    def on_failed(self, rollout: Rollout, store) -> None:
        failed = rollout.status.state == "failed"
        SEEN.append(("failed", failed, rollout.status.error_message, rollout.metadata.sample_idx_in_batch))
"""


def test_v1_hooks_read_and_write_what_v1_models_offer(tmp_path, standins):
    path = write(tmp_path, "models.py", V1_MODEL_ACCESS_HOOK_FILE)
    manager = manager_with(path)
    seen = module_of(manager, path).SEEN
    config = {
        "timeout_seconds": 1800,
        "local": {"agent_class": "pkg:Agent", "env_map": {}},
        "k8s": {"job_template": None},
    }
    out = manager.enqueue(RolloutRequest(rollout_id="r1", group_id="g1", input={"q": 1}, config=config))
    assert seen == [("timeout", 1800, 1800), ("agent", "pkg:Agent", None)]
    assert out.config["timeout_seconds"] == 90 and out.config["local"]["agent_class"] == "pkg:Agent"
    assert dict(out.metadata) == {"batch_idx": 3, "team": "red"}, "only the keys set come back: no v1.0 defaults added"

    done = CompletedRollout(
        rollout_id="r1", group_id="g1", state="succeeded", attempt_id="0", config=out.config, metadata=out.metadata
    )
    manager.on_succeeded(done, {"0": []}, EventWriter())
    failed = CompletedRollout(rollout_id="r2", group_id="g1", state="failed", error="agent crashed")
    manager.on_failed(failed, EventWriter())
    assert seen[2:] == [("succeeded", 1, 3, "red"), ("config", 90, None, "0"), ("failed", True, "agent crashed", None)]
    assert manager.pop_metrics()["training/n_hook_failures"] == 0


# Every name Agent Lightning v1.0's agentlightning/schemas.py defines.
V1_SCHEMA_NAMES = (
    "Event EventCreate ModelRequestData RewardData Model RolloutState VALID_TRANSITIONS TERMINAL_STATES "
    "DEFAULT_ATTEMPT_ID RolloutLocalConfig RolloutK8sConfig RolloutConfig RolloutMetadata RolloutCreate "
    "RolloutLifecycleStatus RolloutStatusPatch RolloutPatch Rollout"
).split()


def test_every_v1_schema_name_resolves_and_models_dump_and_copy(tmp_path):
    names = ", ".join(V1_SCHEMA_NAMES)
    path = write(
        tmp_path,
        "imports.py",
        f"""
        from agentlightning.hooks import RolloutHooks
        from agentlightning.schemas import {names}

        class Imports(RolloutHooks):
            pass
        """,
    )
    manager_with(path)
    from agl_hooks.schemas import RolloutConfig, RolloutCreate, RolloutState

    request = RolloutCreate(input={"a": 1}, config={"timeout_seconds": 5, "local": {"agent_class": "m:A"}})
    assert request.config.local.env_map == {} and request.config.k8s is None
    assert request.model_dump() == {
        "input": {"a": 1},
        "is_train": True,
        "config": {"timeout_seconds": 5, "local": {"agent_class": "m:A", "env_map": {}}, "k8s": None},
        "metadata": None,
        "rollout_id": None,
    }
    deep = request.model_copy(deep=True)
    deep.config.local.agent_class = "m:B"
    assert request.config.local.agent_class == "m:A"
    assert RolloutConfig().timeout_seconds == 3600 and str(RolloutState.FAILED) == "failed"
    with pytest.raises(AttributeError, match="RolloutConfig has no field 'timeout'"):
        _ = RolloutConfig().timeout


def test_a_hook_class_imported_from_a_helper_module_is_found(tmp_path):
    write(
        tmp_path,
        "shared_hooks_helper.py",
        """
        from agentlightning.hooks import RolloutHooks

        class SharedHooks(RolloutHooks):
            def on_startup(self, store=None):
                STARTED.append(True)

        STARTED = []
        """,
    )
    path = write(tmp_path, "uses_helper.py", "from shared_hooks_helper import SharedHooks\n")
    try:
        manager = manager_with(path)
        manager.on_startup(config={})
        assert sys.modules["shared_hooks_helper"].STARTED == [True]
        assert str(tmp_path) not in sys.path, "the file's directory is on sys.path only while it is imported"
    finally:
        sys.modules.pop("shared_hooks_helper", None)


def test_the_same_hook_file_listed_twice_is_one_clear_error(tmp_path):
    path = write(tmp_path, "mod_hooks.py", MODULE_HOOK_FILE)
    with pytest.raises(PluginError) as info:
        PluginManager.from_config(
            {"agentlightning": {"hooks": [str(path), str(tmp_path / "." / "mod_hooks.py")]}}, load_entrypoints=False
        )
    assert (
        str(info.value)
        == f"hook file {path.resolve()} is listed twice in agentlightning.hooks; list each hook file once"
    )


def test_registering_a_second_plugin_under_a_taken_name_does_not_dump_every_plugin():
    manager = PluginManager(load_entrypoints=False)
    with pytest.raises(PluginError) as info:
        manager.register(_StartupLogger("x"), name="losses")
    assert (
        str(info.value)
        == "a plugin named 'losses' is already registered (built-in); register this one under another name"
    )


@pytest.mark.parametrize("code", ["3", "0", "'bye'"])
def test_sys_exit_while_importing_a_hook_file_is_a_clear_error(tmp_path, code):
    path = write(tmp_path, "exits.py", f"import sys\nsys.exit({code})\n")
    with pytest.raises(
        HookFileError, match=rf"hook file {path.resolve()} called sys.exit\({code}\) while being imported"
    ):
        load_hook_file(path)


def test_only_the_methods_a_v1_class_overrides_are_hook_implementations(tmp_path):
    path = write(
        tmp_path,
        "succeeded_only.py",
        """
        from agentlightning.hooks import RolloutHooks

        class Scores(RolloutHooks):
            def on_succeeded(self, rollout, events, store):
                pass
        """,
    )
    manager = manager_with(path)
    assert manager.implementations("agl_on_succeeded") and not manager.implementations("agl_on_enqueue")
    assert not manager.implementations("agl_on_startup") and not manager.implementations("agl_on_failed")


def test_override_detection_compares_with_the_base_that_defines_each_hook():
    """A class deriving from Agent Lightning's own ``RolloutHooks`` (here a class of that name and
    module, so the check runs without Agent Lightning too) overrides only what it defines."""
    al_base = type("RolloutHooks", (), {m: getattr(rollout_hooks.RolloutHooks, m) for m in rollout_hooks.HOOK_METHODS})
    al_base.__module__ = "agentlightning.hooks"
    middle = type("Middle", (al_base,), {"on_failed": lambda self, rollout, store: None})
    leaf = type("Leaf", (middle,), {"on_succeeded": lambda self, rollout, events, store: None})
    assert rollout_hooks.overridden_methods(leaf) == ("on_succeeded", "on_failed")
    assert rollout_hooks.overridden_methods(al_base) == ()
    plugin = rollout_hooks.RolloutHooksPlugin(leaf())
    assert plugin.agl_on_enqueue is None and plugin.agl_on_startup is None and plugin.agl_on_succeeded is not None


# A v1.0 hook file as Agent Lightning's own users write it: pydantic behaviour of its models included.
AL_PYDANTIC_HOOK_FILE = """
import json

from agentlightning.hooks import RolloutHooks
from agentlightning.schemas import Event, Rollout, RolloutConfig, RolloutCreate, RolloutMetadata

SEEN = []


class Pydantic(RolloutHooks):
    def on_enqueue(self, request):
        assert isinstance(request, RolloutCreate) and isinstance(request.config, RolloutConfig)
        SEEN.append(("enqueue", json.loads(request.model_dump_json())["config"]["timeout_seconds"]))
        again = RolloutCreate.model_validate(request.model_dump())
        return again.model_copy(update={"metadata": RolloutMetadata(batch_idx=7, team="blue")})

    def on_succeeded(self, rollout, events, store):
        assert isinstance(rollout, Rollout) and isinstance(rollout.metadata, RolloutMetadata)
        assert all(isinstance(e, Event) for evs in events.values() for e in evs)
        dumped = json.loads(rollout.model_dump_json())
        event_types = [e.event_type for e in events["a0"]]
        SEEN.append(("succeeded", dumped["status"]["state"], dumped["metadata"], event_types))
        dump = {"dump": rollout.metadata.model_dump()}
        store.add_event(rollout.rollout_id, rollout.status.last_attempt_id, "judge", dump)

    def on_failed(self, rollout, store):
        SEEN.append(("failed", Rollout.model_validate_json(rollout.model_dump_json()).status.error_message))
"""


def test_with_agent_lightning_installed_hooks_get_its_pydantic_models(tmp_path):
    pytest.importorskip("agentlightning", reason="needs Agent Lightning installed (Python >= 3.12: scripts/al_lane.sh)")
    import agentlightning.hooks

    path = write(tmp_path, "pydantic_hooks.py", AL_PYDANTIC_HOOK_FILE)
    manager = manager_with(path)
    plugin = manager.get_plugin(f"hookfile:{path.resolve()}")
    assert isinstance(plugin.hooks, agentlightning.hooks.RolloutHooks)
    assert not manager.implementations("agl_on_startup"), "a method the class does not override is no hook"
    seen = module_of(manager, path).SEEN
    config = {
        "timeout_seconds": 1800,
        "local": {"agent_class": "pkg:Agent", "env_map": {"Q": "input.q"}},
        "k8s": {"job_template": None},
    }
    out = manager.enqueue(
        RolloutRequest(rollout_id="r1", group_id="g1", input={"q": 1}, config=config, metadata={"batch_idx": 0})
    )
    assert seen == [("enqueue", 1800)]
    assert out.config == config and dict(out.metadata) == {"batch_idx": 7, "team": "blue"}
    assert out.rollout_id == "r1" and out.input == {"q": 1}

    done = CompletedRollout(
        rollout_id="r1", group_id="g1", state="succeeded", attempt_id="a0", metadata=out.metadata, queued_at=5.0
    )
    writer = EventWriter()
    manager.on_succeeded(done, {"a0": [{"event_type": "model_request", "data": {}, "timestamp": 1.0}]}, writer)
    assert seen[1] == (
        "succeeded",
        "succeeded",
        {"batch_idx": 7, "sample_idx_in_batch": None, "team": "blue"},
        ["model_request"],
    )
    assert [(e.event_type, e.data) for e in writer.pending] == [
        ("judge", {"dump": {"batch_idx": 7, "sample_idx_in_batch": None, "team": "blue"}})
    ]
    manager.on_failed(
        CompletedRollout(rollout_id="r2", group_id="g1", state="failed", error="agent crashed"), EventWriter()
    )
    assert seen[2] == ("failed", "agent crashed")
    assert manager.pop_metrics()["training/n_hook_failures"] == 0


def test_without_agent_lightning_hooks_get_agl_standins():
    if rollout_hooks.v1_models() is not schemas:
        pytest.skip("Agent Lightning is installed here: hooks get its own models (the test above)")
    view = rollout_hooks.rollout_view(
        CompletedRollout(rollout_id="r1", group_id="g1", state="failed", metadata={"k": 1})
    )
    assert isinstance(view, schemas.Rollout) and view.metadata["k"] == 1 and view.status.created_at == 0.0
    assert json.loads(view.model_dump_json())["status"] == {**view.status.model_dump(), "state": "failed"}


def test_helpers_beside_hooks_are_not_taken_for_misspelt_hooks(tmp_path):
    path = write(
        tmp_path,
        "helpers.py",
        """
        from agl_hooks import RolloutHooks

        def compute_reward(rollout):
            return 1.0

        class A(RolloutHooks):
            def __init__(self):
                self.seen = 0

            def record(self, rollout):
                self.seen += 1

            def on_failed(self, rollout, store):
                self.record(rollout)
        """,
    )
    assert type(load_hook_file(path)).__name__ == "RolloutHooksPlugin"
