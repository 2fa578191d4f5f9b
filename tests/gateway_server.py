"""Start and stop the real Agent Lightning gateway (``agl-server``) on 127.0.0.1 for tests and benchmarks.

The server runs from the Python 3.12 venv built by ``scripts/gateway_venv.sh`` (built on demand
when missing). It is stopped by its PID, never by name.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayServer:
    """One ``agl-server`` process; :meth:`restart` keeps the port and key and loses all state."""

    def __init__(self, key: str = "test-secret-key", port: int | None = None, model_name: str = MODEL_NAME):
        self.key = key
        self.port = port or free_port()
        self.model_name = model_name
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="agl-server-", suffix=".log", delete=False)

    def start(self, timeout: float = 60.0) -> GatewayServer:
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
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def kill(self) -> None:
        """An abrupt crash: SIGKILL by PID, no shutdown."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

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
