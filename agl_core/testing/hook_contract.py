"""The lifecycle-hook contract: what a plugin's ``agl_on_*`` hooks must do with the rollouts they see.

Subclass :class:`HookContract` in a ``test_*.py`` file with the plugin object under test::

    import my_hooks
    from agl_core.testing.contracts import HookContract

    class TestMyHooks(HookContract):
        plugin = my_hooks

The hooks the plugin implements are called as the plugin manager calls them (arguments by name),
directly, so an error is the hook's own and not swallowed. On generated requests and rollouts:

- ``agl_on_enqueue`` returns ``None`` or a valid :class:`~agl_core.data.RolloutRequest` with the
  same ``rollout_id`` and ``group_id``, whose ``to_dict()`` is JSON (the gateway sends it as JSON);
- no hook changes what it is given (the request, the rollout, its events, the run config);
- the failure paths work: ``agl_on_succeeded`` on a rollout without calls, reward or events, and
  ``agl_on_failed`` on a failed rollout with or without an error message, do not raise; events
  the hooks write name the rollout they were given.

Reference mode: ``expected_request(request)`` returns what ``agl_on_enqueue`` should return (a
request or ``None``), compared on every generated request.
"""

from __future__ import annotations

from agl_core.testing import hypothesis_missing

try:
    from hypothesis import given
    from hypothesis import strategies as st
except ModuleNotFoundError as exc:
    raise hypothesis_missing(__name__) from exc

import copy
import inspect
import json
from typing import Any, ClassVar

import pytest

from agl_core.data import CompletedRollout, RolloutRequest
from agl_core.errors import UsageTypeError
from agl_core.plugins import EventWriter
from agl_core.testing.lookup import contract_manager
from agl_core.testing.snapshots import describe_change, shorten, snapshot
from agl_core.testing.strategies import CONTRACT_SETTINGS, completed_rollouts

__all__ = ["HookContract", "call_hook", "check_enqueue", "check_rollout_hooks", "event_maps", "rollout_requests"]

_JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-100, 100),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=8),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def rollout_requests(draw: st.DrawFn) -> RolloutRequest:
    """Requests as the trainer makes them: uuid ids, a dataset row as input, metadata of the batch."""
    return RolloutRequest(
        rollout_id=str(draw(st.uuids())),
        group_id=str(draw(st.uuids())),
        input=draw(st.dictionaries(st.sampled_from(["question", "answer", "id", "tags"]), _JSON, max_size=4)),
        is_train=draw(st.booleans()),
        step=draw(st.integers(0, 50)),
        sample_index=draw(st.integers(0, 7)),
        metadata=draw(st.dictionaries(st.sampled_from(["batch", "epoch", "tags"]), _JSON, max_size=3)),
    )


def event_maps(attempt_id: str = "attempt-0") -> st.SearchStrategy[dict[str, list[dict[str, Any]]]]:
    """A rollout's raw events by attempt: none, or a few with ``event_type``, ``data``, ``timestamp``."""
    event = st.fixed_dictionaries(
        {
            "event_type": st.sampled_from(["span", "reward", "message"]),
            "data": st.dictionaries(st.text(max_size=5), _JSON, max_size=3),
            "timestamp": st.floats(0, 1e9),
        }
    )
    return st.one_of(st.just({}), st.lists(event, max_size=4).map(lambda events: {attempt_id: events}))


def call_hook(plugin: Any, hook_name: str, **kwargs: Any) -> tuple[bool, Any]:
    """Call ``plugin``'s ``hook_name`` with the arguments it takes (pluggy's calling convention);
    ``(False, None)`` when the plugin does not implement it."""
    function = getattr(plugin, hook_name, None)
    if function is None:
        return False, None
    accepted = inspect.signature(function).parameters
    return True, function(**{name: value for name, value in kwargs.items() if name in accepted})


def check_enqueue(plugin: Any, request: RolloutRequest, expected: Any = None, reference: bool = False) -> None:
    """``agl_on_enqueue`` keeps the ids, returns a JSON-able request or ``None``, does not change
    its input; with ``reference``, returns what ``expected`` is."""
    before = request.to_dict()
    implemented, result = call_hook(plugin, "agl_on_enqueue", request=request)
    if not implemented:
        return
    if request.to_dict() != before:
        raise AssertionError(
            "agl_on_enqueue changed its input request: "
            f"{describe_change([before], [request.to_dict()], 'requests', 'rollout_id')}"
        )
    if result is not None:
        if not isinstance(result, RolloutRequest):
            raise AssertionError(
                f"agl_on_enqueue returned {type(result).__name__} ({shorten(result)}); "
                "expected a RolloutRequest or None"
            )
        if (result.rollout_id, result.group_id) != (request.rollout_id, request.group_id):
            raise AssertionError(
                f"agl_on_enqueue changed the ids: ({request.rollout_id!r}, {request.group_id!r}) became "
                f"({result.rollout_id!r}, {result.group_id!r}); rollout_id and group_id are the trainer's"
            )
        try:
            json.dumps(result.to_dict(), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise AssertionError(
                f"agl_on_enqueue returned a request that is not JSON ({exc}): {shorten(result.to_dict(), 300)}"
            ) from None
    if reference:  # None means "keep the request", for the hook as for the reference
        got, want = (
            (request if result is None else result).to_dict(),
            (request if expected is None else expected).to_dict(),
        )
        if got != want:
            change = describe_change([want], [got], "requests", "rollout_id")
            raise AssertionError(
                "agl_on_enqueue's request differs from expected_request's "
                f"('was' the expected, 'now' the hook's): {change}"
            )


def check_rollout_hooks(plugin: Any, rollout: CompletedRollout, events: dict[str, list[dict[str, Any]]]) -> None:
    """``agl_on_succeeded`` / ``agl_on_failed`` run without an error, change neither the rollout nor
    its events, and write events only for the rollout they were given."""
    before_rollout, before_events = snapshot([rollout]), copy.deepcopy(events)
    writer = EventWriter()
    if rollout.state == "succeeded":
        call_hook(plugin, "agl_on_succeeded", rollout=rollout, events=events, writer=writer)
    else:
        call_hook(plugin, "agl_on_failed", rollout=rollout, writer=writer)
    change = describe_change(before_rollout, snapshot([rollout]), "rollouts", "rollout_id")
    if change:
        raise AssertionError(f"the hook changed the rollout it was given: {change}")
    if events != before_events:
        raise AssertionError(
            f"agl_on_succeeded changed the rollout's events: {shorten(before_events, 200)} "
            f"became {shorten(events, 200)}"
        )
    for event in writer.pending:
        if event.rollout_id != rollout.rollout_id:
            raise AssertionError(
                f"the hook wrote event {event.event_type!r} for rollout {event.rollout_id!r}, "
                f"not for the rollout it was given ({rollout.rollout_id!r})"
            )


class HookContract:
    """Base test class: subclass it, set ``plugin`` (the module or object with the hooks)."""

    #: the plugin object under test (a module, a class instance...).
    plugin: ClassVar[Any] = None
    #: the plugins' settings, as under ``agentlightning.plugins``, for ``agl_on_startup``.
    plugin_settings: ClassVar[dict[str, Any]] = {}

    def expected_request(self, request: RolloutRequest) -> RolloutRequest | None:
        """What ``agl_on_enqueue`` should return for ``request`` (the reference); override it.
        Returning ``NotImplemented`` (the default) skips the comparison."""
        return NotImplemented

    @pytest.fixture(autouse=True)
    def _plugin_registers(self) -> None:
        """The plugin fits the hookspecs (registered in a contract manager) before any example."""
        if self.plugin is None:
            raise UsageTypeError(f"{type(self).__name__} must set plugin to the object whose hooks are under test")
        contract_manager([self.plugin], self.plugin_settings)

    def test_startup_takes_the_run_config_and_settings(self):
        from agl_core.config import default_config, redacted

        manager = contract_manager([self.plugin], self.plugin_settings)
        config = redacted(default_config())
        before = config.copy()
        call_hook(self.plugin, "agl_on_startup", config=config, settings=manager.settings)
        if config != before:
            raise AssertionError("agl_on_startup changed the run config it was given")

    @given(request=rollout_requests())
    @CONTRACT_SETTINGS
    def test_enqueue_returns_a_valid_request(self, request):
        check_enqueue(self.plugin, request)

    @given(request=rollout_requests())
    @CONTRACT_SETTINGS
    def test_enqueue_matches_the_reference(self, request):
        expected = self.expected_request(request)
        if expected is NotImplemented:
            pytest.skip("no expected_request given")
        check_enqueue(self.plugin, request, expected, reference=True)

    @given(rollout=completed_rollouts(), events=event_maps())
    @CONTRACT_SETTINGS
    def test_succeeded_leaves_its_inputs_alone(self, rollout, events):
        check_rollout_hooks(self.plugin, rollout, events)

    @given(rollout=completed_rollouts(max_calls=2), error=st.one_of(st.none(), st.just("agent crashed: ValueError")))
    @CONTRACT_SETTINGS
    def test_failure_paths_do_not_raise(self, rollout, error):
        import attrs

        bare = attrs.evolve(rollout, triplets=(), final_reward=None)
        check_rollout_hooks(self.plugin, bare, {})
        check_rollout_hooks(self.plugin, attrs.evolve(rollout, state="failed", error=error, final_reward=None), {})
