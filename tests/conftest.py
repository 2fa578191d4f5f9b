"""Fixtures every test package shares: the recorded gateway traces (tests/fixtures/) and a real gateway.

Code the tests share that is not a fixture lives in tests/helpers/."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.helpers.gateway_server import GatewayServer
from tests.helpers.paths import GATEWAY_TRACES

# A third-party package whose tests run against the installed wheel (scripts/wheel_smoke.sh), not here.
collect_ignore = ["wheel_smoke"]

# Hypothesis's per-example deadline and its too-slow health check time the machine, not the code: on
# a loaded machine they fail tests that are right. Every property test here runs without them.
# AGL_HYPOTHESIS_PROFILE=agl-tests-fast draws 20 examples per property instead of 100 (the Agent
# Lightning lanes: they check agl in another environment, the main lane checks the properties).
settings.register_profile("agl-tests", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("agl-tests-fast", settings.get_profile("agl-tests"), max_examples=20)
settings.load_profile(os.environ.get("AGL_HYPOTHESIS_PROFILE", "agl-tests"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for ``pytest -n N --dist loadgroup`` (.ci/run runs the suite so): the tests that start
    Ray clusters (marker ``ray``) are one group, run one after another on one worker (a Ray started
    without an address joins one already running on the machine), and go first, being the longest;
    every other file is a group of its own, so its module fixtures (a gateway, a built policy) start
    once."""
    ray = [item for item in items if item.get_closest_marker("ray")]
    for item in items:
        group = "ray" if item.get_closest_marker("ray") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    if config.getoption("dist", "no") == "loadgroup":
        items[:] = ray + [item for item in items if not item.get_closest_marker("ray")]


@pytest.fixture(autouse=True)
def _no_ray_joined_outside_ray_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test not marked ``ray`` that starts Ray anyway starts its own (``RAY_ADDRESS=local``), never
    joining the cluster of a ``ray`` test running beside it."""
    if request.node.get_closest_marker("ray") is None:
        monkeypatch.setenv("RAY_ADDRESS", "local")


@pytest.fixture(scope="session")
def gateway_traces() -> dict:
    """The scenarios recorded from the real gateway in front of a real vLLM (see their README)."""
    return json.loads((GATEWAY_TRACES / "traces.json").read_text())["scenarios"]


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Qwen2 model and tokenizer that produced the recorded traces."""
    return GATEWAY_TRACES / "tiny_qwen2"


@pytest.fixture(scope="session")
def vision_policy_dir(tmp_path_factory) -> Path:
    """The tiny Qwen2-VL policy (seed 0) whose ids and log-probs tests/fixtures/vl_recording holds."""
    from agl_core.testing.vision_policy import build_vision_policy

    return build_vision_policy(tmp_path_factory.mktemp("vision_policy"), seed=0)


@pytest.fixture(scope="module")
def gateway():
    """A real ``agl-server`` on 127.0.0.1 for the module's tests; stopped by PID afterwards."""
    with GatewayServer() as server:
        yield server
