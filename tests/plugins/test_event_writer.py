"""Events written by hooks are buffered, copied, and survive a failed flush for a retry."""

from __future__ import annotations

import pytest

from agl_core.plugins.event_writer import EventWriter


def test_failed_flush_keeps_the_unsent_events_in_order():
    writer = EventWriter()
    data = {"value": 1.0}
    writer.add_event("r", "a", "reward", data)
    writer.add_event("r", "a", "note", {"n": 2})
    data["value"] = 99.0  # the writer holds a copy, not the hook's dict
    sent = []

    def flaky(event):
        if len(sent) == 1 and not getattr(flaky, "failed", False):
            flaky.failed = True
            raise ConnectionError("gateway down")
        sent.append(event)

    with pytest.raises(ConnectionError):
        writer.flush(flaky)
    assert [e.event_type for e in writer.pending] == ["note"]
    assert writer.flush(flaky) == 1
    assert [(e.event_type, e.data) for e in sent] == [("reward", {"value": 1.0}), ("note", {"n": 2})]


@pytest.mark.parametrize("event_type, data, error", [("", {}, ValueError), ("reward", [1], TypeError)])
def test_bad_events_are_refused_at_once(event_type, data, error):
    with pytest.raises(error):
        EventWriter().add_event("r", "a", event_type, data)
