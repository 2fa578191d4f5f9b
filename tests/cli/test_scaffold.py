"""``agl new-plugin`` writes a plugin package that uses only the public API and passes its own tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agl_core.cli import main
from agl_core.scaffold import ScaffoldError, new_plugin
from tests.helpers.imports import private_imports


def test_the_package_has_an_entry_point_one_stub_per_registry_and_tests(tmp_path, capsys):
    assert main(["new-plugin", "my-judge", "--dir", str(tmp_path)]) == 0
    assert "wrote plugin 'my-judge'" in capsys.readouterr().out
    root = tmp_path / "my-judge"
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == [
        "README.md",
        "pyproject.toml",
        "src/my_judge/__init__.py",
        "tests/test_contracts.py",
        "tests/test_training.py",
    ]
    project = (root / "pyproject.toml").read_text()
    assert 'name = "my-judge"' in project
    assert '[project.entry-points.agl]\nmy_judge = "my_judge"\n' in project
    source = (root / "src" / "my_judge" / "__init__.py").read_text()
    for hook in (
        "agl_plugin_settings",
        "agl_register_aggregators",
        "agl_register_advantage_estimators",
        "agl_register_policy_losses",
        "agl_on_succeeded",
    ):
        assert f"def {hook}(" in source
    for path in root.rglob("*.py"):
        assert private_imports(path.read_text()) == [], path
        compile(path.read_text(), str(path), "exec")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("My Plugin", "must be lower-case letters"),
        ("grpo", "taken by an agl built-in"),
        ("trajectory", "taken by an agl built-in"),
    ],
)
def test_a_bad_or_taken_name_is_refused(tmp_path, name, message):
    with pytest.raises(ScaffoldError, match=message):
        new_plugin(name, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_folder_is_never_overwritten(tmp_path, capsys):
    (tmp_path / "judge").mkdir()
    assert main(["new-plugin", "judge", "--dir", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert list((tmp_path / "judge").iterdir()) == []


@pytest.mark.slow
def test_the_generated_package_passes_its_tests_out_of_the_box(tmp_path):
    root = new_plugin("smoke-plugin", tmp_path)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root / "src"), os.getcwd(), os.environ.get("PYTHONPATH", "")]),
    }
    # agl-fast, the profile the plugin guide gives for CI: what is checked here is that every
    # test passes or skips for an opt-in reason, not the contracts' depth (their own tests have that).
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-rs", "--hypothesis-profile", "agl-fast"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout
    # Only the opt-in checks skip: a reference, hand-computed cases, declarations the template leaves to the author.
    reasons = [line.split(": ", 1)[-1] for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    opt_in = (
        "no reference",
        "no hand-computed cases",
        "no expected_request",
        "declares no trained_calls",
        "declares no length",
    )
    assert all(any(why in reason for why in opt_in) for reason in reasons), reasons
