"""Ports and process groups of the local servers agl starts (vLLM; in tests the gateway and controller).

Each server is started with ``start_new_session=True`` so it leads its own process group: stopping
the group by its PID also stops the workers it spawned, and nothing outside it is ever signalled.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_group(process: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM the group ``process`` leads, then SIGKILL it if it outlives ``grace`` seconds."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=grace)


def kill_process_group(process: subprocess.Popen, wait: float = 20.0) -> None:
    """SIGKILL the group ``process`` leads at once: an abrupt crash, as a fault would cause."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=wait)
