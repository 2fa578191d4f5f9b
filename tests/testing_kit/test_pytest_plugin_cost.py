"""agl's pytest plugin (the ``pytest11`` entry point) costs next to nothing in a session that does not
use the kit: it imports no hypothesis and at most a few modules of agl, and registers agl's hypothesis
profiles only when a run asks for one."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """\
import json, sys

def test_probe():
    with open("modules.json", "w") as f:
        json.dump(sorted(sys.modules), f)
"""


def modules_of_a_session(folder, *options: str) -> set[str]:
    (folder / "test_probe.py").write_text(PROBE)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options, "test_probe.py"],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return set(json.loads((folder / "modules.json").read_text()))


def test_a_session_that_does_not_use_the_kit_imports_no_hypothesis_and_few_modules(tmp_path):
    with_plugin = modules_of_a_session(tmp_path)
    without = modules_of_a_session(tmp_path, "-p", "no:agl")
    added = with_plugin - without
    assert "agl_core.testing.pytest_plugin" in added and "hypothesis" not in with_plugin
    assert len(added) <= 10, sorted(added)


def test_agls_profiles_are_registered_when_a_run_asks_for_one(tmp_path):
    (tmp_path / "test_profile.py").write_text(
        "from hypothesis import settings\n\ndef test_profile():\n    assert settings.default.max_examples == 20\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--hypothesis-profile", "agl-fast"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
