"""Fixtures every test package shares: the recorded gateway traces (tests/fixtures/) and a real gateway.

Code the tests share that is not a fixture lives in tests/helpers/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.helpers.gateway_server import GatewayServer
from tests.helpers.paths import GATEWAY_TRACES

# A third-party package whose tests run against the installed wheel (scripts/wheel_smoke.sh), not here.
collect_ignore = ["wheel_smoke"]

# Hypothesis's per-example deadline and its too-slow health check time the machine, not the code: on
# a loaded machine they fail tests that are right. Every property test here runs without them.
settings.register_profile("agl-tests", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("agl-tests")


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
