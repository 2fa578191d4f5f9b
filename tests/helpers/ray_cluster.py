"""A real Ray cluster of several nodes on this machine, for multi-node tests.

Each node is a ``ray start --block`` process on 127.0.0.1 with its own temp dir, its own ports and
its own resources, leading its own process group: the raylet, the object store and the workers it
spawns stop with the group, signalled by the node's PID, never by name. Custom resources let a
test place work on one node (``resources={"worker_node": 1}``), and a node's working directory
and ``PYTHONPATH`` are its own, so what a test ships to it through Ray's runtime env is provably
not simply found there.

A node can be killed mid-run (:meth:`Node.kill`) to lose it, as a machine going away would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from agl_core.serving.processes import free_port
from tests.helpers.waiting import wait_until

RAY = Path(sys.executable).with_name("ray")
HOST = "127.0.0.1"
STOP_GRACE_S = 30.0
# How long ``ray start --block`` may take to end on SIGTERM before the node's processes are killed: it
# rarely ends within 30 s (in CI each node's stop waited all of it), and a test's node keeps nothing
# that a graceful stop would save.
TERM_GRACE_S = 5.0
STARTED = "Ray runtime started."  # what ``ray start`` prints once its node has joined the cluster
RAY_START_TIMEOUT = "The current node timed out during startup"
START_ATTEMPTS = 3


class Node:
    """One ``ray start --block`` process (a head or a worker node); stopped by its process group's PID."""

    def __init__(self, name: str, args: list[str], *, cwd: Path, env: Mapping[str, str]):
        self.name = name
        self.args, self.cwd, self.env = args, cwd, dict(env)
        self.attempts = 0
        self.temp_dir = Path(tempfile.mkdtemp(prefix=f"ray-{name}-", dir="/tmp"))  # short: Ray's socket paths
        self.log_path = self.temp_dir / "ray-start.log"
        self.process = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        self.attempts += 1
        command = [str(RAY), "start", "--block", f"--node-ip-address={HOST}", f"--temp-dir={self.temp_dir}", *self.args]
        with self.log_path.open("ab") as log:
            return subprocess.Popen(
                command, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_started(self) -> None:
        """Return once ``ray start`` says the node runs (its raylet registered with the cluster).

        Ray 2.60 gives its own processes fixed start-up waits (15 s for the node's agents, 30 s to
        register), which a heavily loaded machine outlasts: ``ray start`` then exits with Ray's
        start-up timeout, and is started again, up to :data:`START_ATTEMPTS` times in all."""

        def started() -> bool:
            if not self.alive():
                log = self.log_text()
                assert RAY_START_TIMEOUT in log and self.attempts < START_ATTEMPTS, (
                    f"ray start of the {self.name} node exited (attempt {self.attempts}):\n{log}"
                )
                self._signal(signal.SIGKILL)  # what the failed start left behind
                self.process = self._spawn()
                return False
            return STARTED in self.log_path.read_text(errors="replace")

        wait_until(started, f"the {self.name} Ray node starting", timeout=900, interval=0.5)

    def kill(self) -> None:
        """SIGKILL every process of the node at once: the node is lost, as when its machine dies."""
        for pid in [self.process.pid, *descendants(self.process.pid)]:
            _kill(pid, signal.SIGKILL)
        self.process.wait(timeout=STOP_GRACE_S)

    def stop(self) -> None:
        """SIGTERM the node's process group, then SIGKILL what is left of the node."""
        tree = descendants(self.process.pid)
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        for pid in [self.process.pid, *tree]:  # Ray's daemons may outlive ``ray start`` itself
            _kill(pid, signal.SIGKILL)
        self.process.wait(timeout=STOP_GRACE_S)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def descendants(pid: int) -> list[int]:
    """The PIDs of every process below ``pid`` (Linux ``/proc``). Ray gives each worker process its
    own process group, so signalling the node's group alone leaves its workers running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


class RayCluster:
    """A head node and worker nodes on 127.0.0.1, each with its own temp dir and ports.

    ``env`` is the environment of every node (``RAY_AUTH_MODE=disabled`` and the like); a worker
    node may get its own ``cwd`` and ``PYTHONPATH`` through :meth:`add_worker`. Use as a context
    manager: every node is stopped on exit, whatever happened."""

    def __init__(self, env: Mapping[str, str] | None = None):
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
        self.head: Node | None = None
        self.workers: list[Node] = []
        self.port = free_port()
        self.used_ports = {self.port}  # every port given to a node of this cluster: none is given twice

    @property
    def address(self) -> str:
        """The GCS address drivers and nodes join (``ray.init(address=...)``, ``RAY_ADDRESS``)."""
        return f"{HOST}:{self.port}"

    def start_head(self, num_cpus: int, resources: Mapping[str, float] | None = None, cwd: Path | None = None) -> Node:
        args = [
            "--head",
            f"--port={self.port}",
            "--include-dashboard=false",
            *self._ports("dashboard-port"),
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            f"--resources={json.dumps(dict(resources or {}))}",
            *self._ports(
                "ray-client-server-port", "node-manager-port", "object-manager-port", "runtime-env-agent-port"
            ),
            *self._ports("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port"),
            *self._worker_ports(),
        ]
        self.head = Node("head", args, cwd=cwd or Path(tempfile.gettempdir()), env=self.env)
        self.head.wait_started()
        return self.head

    def add_worker(
        self,
        num_cpus: int,
        resources: Mapping[str, float] | None = None,
        *,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Node:
        """A worker node joining the head, with ``resources`` (a custom resource places work on it),
        its own working directory and extra environment (a different ``PYTHONPATH``...)."""
        args = [
            f"--address={self.address}",
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            f"--resources={json.dumps(dict(resources or {}))}",
            *self._ports("node-manager-port", "object-manager-port", "runtime-env-agent-port"),
            *self._ports("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port"),
            *self._worker_ports(),
        ]
        name, cwd = f"worker{len(self.workers)}", cwd or Path(tempfile.gettempdir())
        node = Node(name, args, cwd=cwd, env={**self.env, **(env or {})})
        self.workers.append(node)
        node.wait_started()
        return node

    def _ports(self, *names: str) -> list[str]:
        """``--NAME=PORT`` for each name, each a free port not given to this cluster before."""
        args = []
        for name in names:
            port = free_port()
            while port in self.used_ports:
                port = free_port()
            self.used_ports.add(port)
            args.append(f"--{name}={port}")
        return args

    def _worker_ports(self) -> list[str]:
        """Ports for the node's worker processes, 41 from a free one up (Ray's default range is shared),
        none of them a port this cluster gave already (Ray refuses a node whose ports collide)."""
        low = free_port()
        while self.used_ports & set(range(low, low + 41)):
            low = free_port()
        self.used_ports.update(range(low, low + 41))
        return [f"--min-worker-port={low}", f"--max-worker-port={low + 40}"]

    def stop(self) -> None:
        for node in [*self.workers, *([self.head] if self.head else [])]:
            node.stop()

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
