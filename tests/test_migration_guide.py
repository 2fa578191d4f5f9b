"""``docs/migrating-from-agent-lightning.md`` runs as written: its files are written, its ``console``
commands run (``agl`` and ``python`` as this interpreter, ``$AGL_URL`` / ``$AGL_KEY`` a real gateway
this test starts) and print what the guide shows; its install command installs this distribution from
its source folder; its gateway commands (``agl-server``, ``agl-controller``) start a gateway and a
controller that runs the gateway's rollouts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import tomllib

import pytest

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
    assert installs == ["pip install ./agl"]  # the source folder: the distribution is not on the registry
    assert f"`{name}`, is not on the package\nregistry" in GUIDE.read_text()
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


def gateway_commands() -> dict[str, list[str]]:
    """The guide's ``agl-server`` and ``agl-controller`` command lines, by program."""
    lines = [line for lang, _, text in blocks() if lang == "bash" for line in text.splitlines()]
    return {line.split()[0]: line.split()[1:] for line in lines if line.startswith(("agl-server ", "agl-controller "))}


def test_the_guides_gateway_and_controller_commands_run_rollouts(tmp_path):
    """Both commands as written (the port and key replaced by the test's): the controller picks up a
    rollout created on the keyed gateway (without its key it would poll and get 401 forever)."""
    from agl_core.data import RolloutRequest
    from agl_core.rollouts.gateway_client import GatewayClient
    from agl_core.serving.processes import free_port, stop_process_group
    from tests.helpers.gateway_server import gateway_bin

    commands = gateway_commands()
    assert set(commands) == {"agl-server", "agl-controller"}
    port, key = free_port(), "guide-test-key"

    def argv(program: str) -> list[str]:
        args = [a.replace("8080", str(port)).replace("$AGL_KEY", key) for a in commands[program]]
        quiet = ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled"]
        return [str(gateway_bin(program)), *args, *quiet]

    logs = {name: (tmp_path / f"{name}.log").open("wb") for name in commands}
    processes = []
    try:
        for program in ("agl-server", "agl-controller"):
            processes.append(
                subprocess.Popen(
                    argv(program), stdout=logs[program], stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True
                )
            )
            if program == "agl-server":
                with GatewayClient(f"http://127.0.0.1:{port}", key, timeout_seconds=2.0) as probe:
                    deadline = time.monotonic() + 60
                    while time.monotonic() < deadline and not _answers(probe):
                        time.sleep(0.1)
        with GatewayClient(f"http://127.0.0.1:{port}", key) as client:
            client.create_rollouts([RolloutRequest(rollout_id="guide-1", group_id="g", input={})])
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                state = client.get_rollout("guide-1")["rollout"]["status"]["state"]
                if state != "queuing":
                    break
                time.sleep(0.2)
        log = (tmp_path / "agl-controller.log").read_text(errors="replace")
        assert state != "queuing", f"the controller never started the rollout:\n{log[-3000:]}"
        assert "401" not in log
    finally:
        for process in reversed(processes):
            stop_process_group(process, grace=10)
        for log in logs.values():
            log.close()


def _answers(client) -> bool:
    try:
        client.proxy_state()
    except Exception:
        return False
    return True
