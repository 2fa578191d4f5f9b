"""Every hookspec is documented and exercised by some test."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from agl_core import hookspecs
from tests.helpers.paths import TESTS

HOOKSPECS = sorted(name for name, obj in vars(hookspecs).items() if name.startswith("agl_") and inspect.isfunction(obj))


def test_the_module_docstring_counts_the_kinds_it_lists():
    """ "N kinds of hooks live here:" is followed by N bullets, one per kind, and they cover every hookspec."""
    doc = inspect.getdoc(hookspecs) or ""
    counted = doc.split(" kinds of hooks live here:")[0].split()[-1].lower()
    bullets = [line for line in doc.splitlines() if line.startswith("* **")]
    assert ["one", "two", "three", "four", "five", "six"].index(counted) + 1 == len(bullets), bullets
    for name in HOOKSPECS:
        assert any(name in b or name.startswith(b.split("``")[1].rstrip("*")) for b in bullets if "``" in b), name


def test_there_are_hookspecs():
    assert {"agl_register_aggregators", "agl_on_enqueue", "agl_on_succeeded"} <= set(HOOKSPECS)


@pytest.mark.parametrize("name", HOOKSPECS)
def test_hookspec_has_a_real_docstring(name):
    doc = inspect.getdoc(getattr(hookspecs, name)) or ""
    assert len(doc.split()) >= 20, (
        f"hookspec {name} needs a docstring saying when it is called, with what, and what it returns"
    )


@pytest.mark.parametrize("name", HOOKSPECS)
def test_hookspec_is_implemented_by_some_test(name):
    """A test implements the hook (and so calls it through the plugin manager) somewhere in tests/."""
    users = [
        path.name
        for path in TESTS.rglob("test_*.py")
        if path.name != Path(__file__).name and f"def {name}(" in path.read_text()
    ]
    assert users, f"no test implements hookspec {name}"
