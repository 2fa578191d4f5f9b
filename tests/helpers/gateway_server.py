"""Start and stop the real Agent Lightning gateway (``agl-server``) on 127.0.0.1 for tests and benchmarks.

The server runs from the Python 3.12 venv built by ``scripts/gateway_venv.sh`` (built on demand
when missing). It is stopped by its PID, never by name.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from agl_core.serving.processes import free_port, kill_process_group, stop_process_group
from tests.helpers.paths import REPO_ROOT

GATEWAY_VENV = Path(os.environ.get("AGL_GATEWAY_VENV", REPO_ROOT / ".venvs" / "gateway"))
MODEL_NAME = "agl-test-model"


def gateway_bin(name: str = "agl-server") -> Path:
    """The gateway venv's executable ``name``, building the venv first if it is missing."""
    path = GATEWAY_VENV / "bin" / name
    if not path.exists():
        subprocess.run(["bash", str(REPO_ROOT / "scripts" / "gateway_venv.sh")], check=True)
    if not path.exists():
        raise FileNotFoundError(f"{path} missing after scripts/gateway_venv.sh")
    return path


class GatewayServer:
    """One ``agl-server`` process; :meth:`restart` keeps the port and key and loses all state."""

    def __init__(self, key: str = "test-secret-key", port: int | None = None, model_name: str = MODEL_NAME):
        self.key = key
        self.port = port or free_port()
        self.model_name = model_name
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="agl-server-", suffix=".log", delete=False)

    def start(self, timeout: float = 300.0) -> GatewayServer:
        args = [
            str(gateway_bin()),
            "host=127.0.0.1",
            f"port={self.port}",
            f"key={self.key}",
            f"default_proxy.model_name={self.model_name}",
            "hydra.run.dir=.",
            "hydra.output_subdir=null",
            "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled",
        ]
        self.process = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(), start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"agl-server exited with {self.process.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"agl-server did not answer /healthz within {timeout}s:\n{self.log_text()}")

    def stop(self) -> None:
        """SIGTERM then SIGKILL, by PID (and its own process group, which only it leads)."""
        process, self.process = self.process, None
        if process is not None:
            stop_process_group(process, grace=10)

    def kill(self) -> None:
        """An abrupt crash: SIGKILL by PID, no shutdown."""
        process, self.process = self.process, None
        if process is not None:
            kill_process_group(process, wait=10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def log_text(self) -> str:
        return Path(self._log.name).read_text(errors="replace")[-4000:]

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        os.unlink(self._log.name)


class Controller:
    """One ``agl-controller runner_type=local`` against ``gateway``, running at most ``pool`` agents at
    once; the agents (``examples.corridor.agent``...) are imported from this checkout. Stopped by PID."""

    def __init__(self, gateway: GatewayServer, pool: int, log_path: Path | None = None):
        self.gateway = gateway
        self.pool = pool
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="agl-controller-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        args = [
            str(gateway_bin("agl-controller")),
            "runner_type=local",
            f"agl_server.url={self.gateway.url}",
            f"agl_server.key={self.gateway.key}",
            "local_runner.poll_interval=0.2",
            f"local_runner.maximum_size={self.pool}",
            "hydra.run.dir=.",
            "hydra.output_subdir=null",
            "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled",
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, cwd=self.log_path.parent, env=env, start_new_session=True
            )

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            stop_process_group(process, grace=15)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]
