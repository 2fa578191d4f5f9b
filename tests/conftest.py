"""Shared test fixtures. The recorded gateway traces live in ../shared/fixtures beside the checkout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_FIXTURES = REPO_ROOT.parent / "shared" / "fixtures"
GATEWAY_TRACES = SHARED_FIXTURES / "gateway_traces"


@pytest.fixture(scope="session")
def gateway_traces() -> dict:
    """The scenarios recorded from the real gateway in front of a real vLLM (see their README)."""
    path = GATEWAY_TRACES / "traces.json"
    if not path.is_file():
        raise FileNotFoundError(f"recorded traces missing: {path} (shared/ must sit beside the checkout)")
    return json.loads(path.read_text())["scenarios"]


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Qwen2 model and tokenizer that produced the recorded traces."""
    return GATEWAY_TRACES / "tiny_qwen2"
