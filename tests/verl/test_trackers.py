"""verl's other trackers (``trainer.logger: [file]``, ``mlflow``...) are metric sinks too, run through
verl's ``Tracking`` in the ``agl train`` process."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.verl

pytest.importorskip("verl")

from verl.utils.tracking import Tracking  # noqa: E402

from agl_backend_verl.verl_trackers import VERL_TRACKERS  # noqa: E402
from agl_core.plugins import DISABLE_AUTOLOAD_ENV  # noqa: E402
from tests.helpers.scripted_backend import scripted_run  # noqa: E402


def test_every_tracker_verl_supports_is_a_sink():
    assert set(VERL_TRACKERS) == set(Tracking.supported_backend) - {"console", "tensorboard", "wandb"}


def test_verl_file_tracker_gets_every_step(tmp_path, monkeypatch):
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")  # agl's own entry points only: the verl one among them
    out = tmp_path / "verl_file.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(out))
    scripted_run(tmp_path / "run", ["file"])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert lines[1]["data"]["training/reward"] == 0.25
