"""``scripts/device_check.py`` kept alive on CPU: its tiny run passes and its report has every section.

The check is written for the lent GPU machine, whose image differs from this project's pins (Python
3.12, transformers 5.17, no verl, Ray or omegaconf); ``docs/gpu.md`` says how it runs there. Here it
runs with ``--device cpu --size tiny``: once under the pinned packages, and once with transformers
5.17.0 (the image's version) installed into a folder put first on ``PYTHONPATH``, so the code path the
device runs is imported and run under both. The numeric checks are also shown to fail when a loss
drifts from its float64 result, and the verl section to record the import error where verl cannot import.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from packaging.version import Version

from agl_core import hookimpl
from agl_core.builtins.losses import token_mean
from agl_core.plugins import PluginManager
from tests.helpers.paths import REPO_ROOT

SCRIPTS = REPO_ROOT / "scripts"
DEVICE_CHECK = SCRIPTS / "device_check.py"
SECTIONS = ["losses", "estimators", "verl", "corridor", "trl", "synthetic", "modes"]
HAS_VERL = importlib.util.find_spec("verl") is not None
HAS_TRL = importlib.util.find_spec("trl") is not None
MODES = ["full fp32", "full bf16", "lora bf16", "lora bf16 + checkpointing"]
IMAGE_TRANSFORMERS = ("transformers==5.17.0", "tokenizers>=0.23.1,<0.24")

sys.path.append(str(SCRIPTS))  # device_numerics, as device_check.py imports it
import device_numerics  # noqa: E402


def run_check(
    out: Path, *args: str, first_on_path: Path | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    path = [str(first_on_path)] if first_on_path else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(REPO_ROOT)])}
    command = [sys.executable, str(DEVICE_CHECK), "--out", str(out), "--device", "cpu", "--size", "tiny", *args]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def passed_report(out: Path, first_on_path: Path | None = None) -> dict:
    # the size's own deadline is the lent machine's time budget; here only a hang may end the run
    result = run_check(out, "--deadline-s", "1800", first_on_path=first_on_path, timeout=2400)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert list(report["sections"]) == SECTIONS
    failed = {name: s for name, s in report["sections"].items() if s["status"] not in ("passed", "unavailable")}
    assert not failed, json.dumps(failed, indent=1)[-4000:]
    assert report["passed"] is True
    return report


def test_the_tiny_cpu_run_passes_and_reports_every_section(tmp_path):
    report = passed_report(tmp_path / "out")
    assert (report["device"], report["size"]) == ("cpu", "tiny")
    # the distribution's version has no local tag; torch.__version__ may (PyPI's CUDA wheel: 2.13.0+cu130)
    assert Version(report["environment"]["packages"]["torch"]).public == Version(torch.__version__).public
    sections = report["sections"]
    for name in ("losses", "estimators"):
        assert set(sections[name]["tolerances"]) == {"float32", "bfloat16"}
        assert sections[name]["n_comparisons"] > 0 and not sections[name]["failures"]
    assert sections["estimators"]["unchecked"] == []
    if HAS_VERL:  # installed with this project: its loss runs, agl's losses through it equal the direct call
        assert sections["verl"]["status"] == "passed"
        assert sections["verl"]["registered"]["policy_losses"] == [
            "cispo_per_rollout_mean",
            "per_rollout_mean",
            "token_mean",
        ]
    else:  # Python 3.13 and later, which verl 0.9 does not support: reported, not failed
        assert sections["verl"]["status"] == "unavailable"
        assert "No module named 'verl'" in sections["verl"]["import_error"]
    corridor = sections["corridor"]
    assert corridor["steps"] == len(corridor["rewards"]) == 8
    assert corridor["reward_rose"] and corridor["reward_last_third"] > corridor["reward_first_third"]
    assert corridor["seconds_per_step"] > 0
    trl = sections["trl"]
    if HAS_TRL:  # the trl backend trains the corridor, on the device it serves from
        for name, steps in (("fp32", 8), ("bf16", 3)):
            run = trl["runs"][name]
            assert run["status"] == "passed" and run["steps"] == len(run["rewards"]) == steps, run
            assert run["trains_on"] == run["serves_on"] == "cpu"
        assert trl["runs"]["fp32"]["reward_rose"]
    else:
        assert trl["status"] == "unavailable" and "No module named" in trl["import_error"]
    synthetic = sections["synthetic"]
    assert synthetic["model"]["dtype"] == "float32" and synthetic["model"]["parameters"] > 0
    assert [s["step"] for s in synthetic["per_step"]] == [1, 2, 3]
    for step in synthetic["per_step"]:
        assert step["rollouts_succeeded"] == 8 and step["generated_tokens"] > 0 and step["trained_tokens"] > 0
        assert step["gen_s"] > 0 and step["update_s"] > 0
    assert synthetic["generated_tokens_per_s"] > 0 and synthetic["trained_tokens_per_s"] > 0
    assert synthetic["mean_after_first_step"]["log_prob_s"] > 0
    shapes = sections["modes"]["shapes"]
    assert list(shapes) == ["tiny", "tiny-wide"] and sections["modes"]["cards_gib"] == [24, 80]
    for shape in shapes.values():
        assert list(shape["modes"]) == MODES and shape["model"]["parameters"] > 0
        for run in shape["modes"].values():
            assert run["status"] == "passed"
            assert run["gen_s"] > 0 and run["log_prob_s"] > 0 and run["actor_update_s"] > 0
            assert run["generated_tokens_per_s"] > 0 and run["trained_tokens_per_s"] > 0
            assert run["peak_allocated_gib"] is None and run["fits"] is None  # measured on a GPU only
    assert all(s["peak_gpu_memory_gib"] is None for s in sections.values())
    lora = json.loads((tmp_path / "out" / "modes-tiny-lora-bf16" / "metrics.jsonl").read_text().splitlines()[-1])
    assert lora["actor/grad_norm"] > 0, "the LoRA run trained its adapter"
    for name in ("corridor", *(["trl-fp32"] if HAS_TRL else []), "synthetic", "modes-tiny-full-fp32"):
        lines = (tmp_path / "out" / name / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == list(range(1, len(lines) + 1))


@pytest.mark.slow
def test_the_tiny_cpu_run_passes_with_the_device_images_transformers(tmp_path):
    target = tmp_path / "image-packages"
    install = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--target",
        str(target),
    ]
    pip = subprocess.run([*install, *IMAGE_TRANSFORMERS], capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        pytest.skip(f"could not install {' '.join(IMAGE_TRANSFORMERS)} to check against: {pip.stderr[-1000:]}")
    report = passed_report(tmp_path / "out", first_on_path=target)
    assert report["environment"]["packages"]["transformers"] == "5.17.0"
    assert report["sections"]["corridor"]["status"] == report["sections"]["synthetic"]["status"] == "passed"


def test_a_deadline_ends_the_run_with_the_report_written(tmp_path):
    result = run_check(tmp_path, "--deadline-s", "1", timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["timed_out"] is True and report["passed"] is False
    assert any("not finished within 1 s" in s.get("error", "") for s in report["sections"].values())


def drifting(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights=None):
    """``token_mean``, 0.1 % off below float64: within bfloat16's tolerance, not within float32's."""
    loss, metrics = token_mean(old_log_prob, log_prob, advantages, response_mask, settings, rollout_is_weights)
    return (loss if loss.dtype == torch.float64 else loss * 1.001), metrics


@hookimpl
def agl_register_policy_losses(register):
    register("drifting", drifting)


@hookimpl
def agl_register_advantage_estimators(register):
    register("constant", lambda rows, settings: None)


def with_test_plugin() -> PluginManager:
    manager = PluginManager()
    plugin = SimpleNamespace(
        agl_register_policy_losses=agl_register_policy_losses,
        agl_register_advantage_estimators=agl_register_advantage_estimators,
    )
    manager.register(plugin, "device-check-test")
    return manager


def test_the_loss_check_fails_a_loss_that_drifts_from_float64():
    result = device_numerics.check_losses("cpu", with_test_plugin())
    assert result["status"] == "failed"
    assert {(f["loss"], f["dtype"]) for f in result["failures"]} == {("drifting", "float32")}
    assert result["worst_errors"]["float32"]["loss"] > device_numerics.TOLERANCES["float32"]["loss"]


def test_an_estimator_without_a_closed_form_is_listed_unchecked():
    result = device_numerics.check_estimators("cpu", with_test_plugin())
    assert result["status"] == "passed"
    assert result["unchecked"] == ["constant"]


@pytest.mark.skipif(not HAS_VERL, reason="verl is not installed: the tiny run's report covers its absence")
def test_the_verl_check_records_the_import_error_where_verl_cannot_import():
    code = (
        "import json, sys; sys.modules['ray'] = None; sys.path.insert(0, sys.argv[1]); import device_numerics; "
        "print(json.dumps(device_numerics.check_verl('cpu')))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code, str(SCRIPTS)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    verl = json.loads(result.stdout.splitlines()[-1])
    assert verl["status"] == "unavailable"
    assert "ray" in verl["import_error"] and "Traceback" in verl["import_error"]
    # ray, removed here, and whatever else of the list this environment lacks (pyvers, with tensordict < 0.10)
    absent = [m for m in device_numerics.VERL_LOSS_MODULES if m == "ray" or importlib.util.find_spec(m) is None]
    assert verl["missing_modules"] == absent and absent[0] == "ray"
