"""Where the repository and the tests' fixtures are, the same from a test at any depth of ``tests/``."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
# The scenarios recorded from the real gateway in front of a real vLLM, and their tiny model.
GATEWAY_TRACES = FIXTURES / "gateway_traces"
# Three recorded steps of the corridor example.
RECORDED_CORRIDOR = FIXTURES / "corridor_recording"
# Multimodal gateway events of the tiny vision-language policy (tests/helpers/vl_recording.py).
VL_RECORDING = FIXTURES / "vl_recording"
