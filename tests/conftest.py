"""Shared test fixtures. The recorded gateway traces and their tiny model live in tests/fixtures/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

GATEWAY_TRACES = Path(__file__).resolve().parent / "fixtures" / "gateway_traces"
# A third-party package whose tests run against the installed wheel (scripts/wheel_smoke.sh), not here.
collect_ignore = ["wheel_smoke"]


@pytest.fixture(scope="session")
def gateway_traces() -> dict:
    """The scenarios recorded from the real gateway in front of a real vLLM (see their README)."""
    return json.loads((GATEWAY_TRACES / "traces.json").read_text())["scenarios"]


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Qwen2 model and tokenizer that produced the recorded traces."""
    return GATEWAY_TRACES / "tiny_qwen2"
