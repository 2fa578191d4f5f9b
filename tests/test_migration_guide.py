"""``docs/migrating-from-agent-lightning.md`` runs as written: its files are written, its ``console``
commands run (``agl`` and ``python`` as this interpreter, ``$AGL_URL`` / ``$AGL_KEY`` a real gateway
this test starts) and print what the guide shows; its install commands name this distribution."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import tomllib

from tests.helpers.gateway_server import GatewayServer
from tests.helpers.paths import REPO_ROOT

pytestmark = [pytest.mark.gateway, pytest.mark.verl, pytest.mark.slow]

GUIDE = REPO_ROOT / "docs" / "migrating-from-agent-lightning.md"
FENCE = re.compile(r"^```(\S*)[ \t]*(\S*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks() -> list[tuple[str, str, str]]:
    """``(language, file name or "", text)`` of every fenced block, in order."""
    return [m.groups() for m in FENCE.finditer(GUIDE.read_text())]


def console_steps(text: str) -> list[tuple[str, list[str]]]:
    """``(command, the lines shown after it)`` of one ``console`` block."""
    steps: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif line.strip():
            steps[-1][1].append(line)
    return steps


def test_the_guide_has_files_commands_and_its_install_names_this_package():
    found = blocks()
    assert {name for _, name, _ in found if name} == {"hooks.py", "make_data.py", "config.yaml"}
    assert sum(len(console_steps(text)) for lang, _, text in found if lang == "console") == 4
    name = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["name"]
    installs = [
        line for lang, _, text in found if lang == "bash" for line in text.splitlines() if "pip install" in line
    ]
    assert installs == [f"pip install {name}"]
    for constraints in re.findall(r"constraints/[\w.-]+\.txt", GUIDE.read_text()):
        assert (REPO_ROOT / constraints).is_file(), constraints


def test_the_guides_steps_run_as_written(tmp_path):
    for _, name, text in blocks():
        if name:
            (tmp_path / name).write_text(text)
    server = GatewayServer().start()
    shell = f'agl() {{ "{sys.executable}" -m agl_core.cli "$@"; }}; python() {{ "{sys.executable}" "$@"; }}; '
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "AGL_URL": server.url,
        "AGL_KEY": server.key,
        "RAY_AUTH_MODE": "disabled",
    }
    try:
        for lang, _, text in blocks():
            if lang != "console":
                continue
            for command, shown in console_steps(text):
                result = subprocess.run(
                    ["bash", "-c", shell + command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
                )
                output = result.stdout + result.stderr
                fails = any(line.startswith("agl: error:") for line in shown)
                assert (result.returncode != 0) == fails, f"{command}\n{output[-3000:]}"
                for line in shown:
                    assert line in output, f"{command}: {line!r} not in\n{output[-3000:]}"
    finally:
        server.stop()
    assert (tmp_path / "train.parquet").is_file()
