"""Fixtures of the torch backend's tests."""

from __future__ import annotations

import pytest

from tests.helpers.corridor_policy import build_corridor_policy


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """The corridor example's tiny policy, built once per module."""
    return build_corridor_policy(tmp_path_factory.mktemp("policy"))
