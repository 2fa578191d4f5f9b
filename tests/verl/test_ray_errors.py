"""Ray's own failures read as Ray's: a start-up timeout, an unreachable cluster, a dead worker or a
lost node end ``agl`` with one ``agl: error:`` line naming Ray, and a hint with the setting that
governs it and what to do; anything else raised in a Ray actor is left as it is."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytestmark = pytest.mark.verl

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

from ray import exceptions as ray_exceptions  # noqa: E402

from agl_backend_verl.ray_errors import (  # noqa: E402
    RayNodeLost,
    RayStartTimeout,
    RayUnreachable,
    RayWorkerDied,
    explain_ray_failure,
    nodes_watched,
    ray_failures_explained,
)
from agl_core.cli import main  # noqa: E402
from agl_core.serving.processes import free_port  # noqa: E402
from tests.helpers.ray_cluster import RayCluster  # noqa: E402
from tests.helpers.verl_configs import write_config  # noqa: E402

# What Ray 2.60 raises when its node does not come up in time (ray._private.node).
START_TIMEOUT = Exception(
    "The current node timed out during startup. This could happen because some of the raylet failed to "
    "startup or the GCS has become overloaded."
)
ACTOR_DIED = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: TaskRunner\n\tactor_id: 48b1\n"
    "\tpid: 6223\n\tnamespace: 4b47\n\tip: 10.0.0.7\nThe actor is dead because its worker process has died. "
    "Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2."
)


def actor_died(message: str = ACTOR_DIED) -> ray_exceptions.ActorDiedError:
    error = ray_exceptions.ActorDiedError()
    error.error_msg = message
    return error


def one_line(failure) -> str:
    text = str(failure)
    assert "\n" not in text, text
    return text


def test_a_start_up_timeout_names_ray_its_waits_and_what_to_do():
    failure = explain_ray_failure(START_TIMEOUT)
    assert isinstance(failure, RayStartTimeout)
    assert one_line(failure) == "Ray did not start: The current node timed out during startup."
    assert "RAY_raylet_start_wait_time_s" in failure.hint and "ray start --head" in failure.hint
    assert "ray_kwargs.ray_init.address" in failure.hint


def test_a_cluster_ray_cannot_reach_is_unreachable():
    failure = explain_ray_failure(ConnectionError("Failed to connect to Ray cluster at 10.0.0.9:6379"))
    assert isinstance(failure, RayUnreachable)
    assert "Ray" in one_line(failure) and "10.0.0.9:6379" in str(failure)
    assert "ray_kwargs.ray_init.address" in failure.hint and "RAY_ADDRESS" in failure.hint


def test_a_dead_actor_names_the_actor_its_process_and_node_in_one_line():
    failure = explain_ray_failure(actor_died())
    assert isinstance(failure, RayWorkerDied)
    assert one_line(failure) == (
        "a Ray worker process died: actor TaskRunner (pid 6223, node 10.0.0.7): "
        "The actor is dead because its worker process has died."
    )
    assert "worker-*.err" in failure.hint and "RAY_memory_usage_threshold" in failure.hint
    assert "trainer.resume_mode=auto" in failure.hint


def test_a_lost_node_is_told_apart_from_a_dead_worker():
    died_with_node = ACTOR_DIED.replace(
        "The actor is dead because its worker process has died.", "The actor died because its node has died."
    )
    for error in (actor_died(died_with_node), ray_exceptions.NodeDiedError("Node 5b18 died: heartbeats missed.")):
        failure = explain_ray_failure(error)
        assert isinstance(failure, RayNodeLost), error
        assert one_line(failure).startswith("Ray lost a node of the cluster: ")
        assert "RAY_health_check_failure_threshold" in failure.hint and "ray status" in failure.hint


def test_an_actor_that_became_unreachable_says_its_process_or_node_is_gone():
    error = ray_exceptions.ActorUnavailableError("RpcError: Socket closed", None)
    failure = explain_ray_failure(error)
    assert isinstance(failure, RayWorkerDied)
    assert one_line(failure).startswith("a Ray actor became unreachable (its process or its node is gone): ")


def test_errors_that_are_not_rays_pass_through_even_from_an_actor():
    assert explain_ray_failure(ValueError("bad batch")) is None
    cause = ValueError("bad batch")
    raised_in_actor = ray_exceptions.RayTaskError("run", "Traceback ...\nValueError: bad batch", cause)
    assert explain_ray_failure(raised_in_actor) is None
    with pytest.raises(ValueError, match="bad batch"):
        with ray_failures_explained():
            raise ValueError("bad batch")


def test_a_ray_error_an_actor_re_raised_as_another_type_is_found_in_its_traceback():
    traceback = f"Traceback (most recent call last):\n  ...\nray.exceptions.ActorDiedError: {ACTOR_DIED}"
    wrapped = ray_exceptions.RayTaskError("run", traceback, RuntimeError("step 3 failed"))
    failure = explain_ray_failure(wrapped)
    assert isinstance(failure, RayWorkerDied) and "Ray worker process died" in str(failure)


class Nodes:
    """A cluster's live nodes as Ray reports them, one report per call (the last one repeated)."""

    def __init__(self, *reports):
        self.reports, self.calls = list(reports), 0

    def __call__(self):
        self.calls += 1
        return self.reports[min(self.calls - 1, len(self.reports) - 1)]


BOTH = {"a1b2c3d4e5f6a7b8": "127.0.0.1", "f0e1d2c3b4a5f6e7": "127.0.0.2"}
HEAD_ONLY = {"a1b2c3d4e5f6a7b8": "127.0.0.1"}
GLOO = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.2]:1234")


def test_an_error_while_a_node_died_names_the_lost_node_and_what_failed_first(monkeypatch):
    """A surviving rank's collective fails before Ray declares its peer's node dead: Ray is asked
    again until it does."""
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    nodes = Nodes(BOTH, BOTH, BOTH, HEAD_ONLY)
    with pytest.raises(RayNodeLost) as lost:
        with nodes_watched(nodes):
            raise ray_exceptions.RayTaskError("run", "Traceback ...", GLOO)
    message = one_line(lost.value)
    assert message.startswith("Ray lost a node of the cluster while the run used it: 127.0.0.2 (f0e1d2c3b4a5)")
    assert "what failed first: RuntimeError: [../third_party/gloo" in message and nodes.calls == 4
    assert isinstance(lost.value.__cause__, ray_exceptions.RayTaskError)


def test_an_error_with_every_node_alive_passes_through_at_once():
    nodes = Nodes(BOTH)
    with pytest.raises(ValueError, match="a bug"):
        with nodes_watched(nodes):
            raise ValueError("a bug in a plugin")
    assert nodes.calls == 2  # on entry, then once: the error does not read as a lost peer


def test_agls_own_errors_are_not_blamed_on_a_lost_node():
    from agl_core.config import ConfigError

    with pytest.raises(ConfigError):
        with nodes_watched(Nodes(BOTH, HEAD_ONLY)):
            raise ConfigError("data.train_files", "dataset file not found: x.jsonl")


def test_the_cli_prints_rays_failure_as_one_error_line_and_a_hint(tmp_path, capsys, monkeypatch):
    """``agl train backend=verl`` told to join a cluster where nothing listens: no minutes of Ray
    retrying, no "internal error"."""
    assert not ray.is_initialized()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    address = f"127.0.0.1:{free_port()}"
    code = main(
        [
            "train",
            str(write_config(tmp_path, backend="torch")),
            "backend=verl",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "agentlightning.agl_base_url=http://127.0.0.1:9",  # never contacted: Ray comes first
            "actor_rollout_ref.rollout.name=vllm",
            "trainer.n_gpus_per_node=1",  # one rank: the checks before Ray pass
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
            f"ray_kwargs.ray_init.address={address}",
        ]
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("agl: ")]  # not the progress bar
    assert code == 2 and len(err) == 2, err
    assert err[0].startswith(f"agl: error: no Ray cluster answers at {address} (ray_kwargs.ray_init.address")
    assert "internal error" not in err[0]
    assert err[1].startswith("agl: hint: start the cluster there (`ray start --head --port=PORT`)")
    assert not ray.is_initialized()


def runner_killing_its_worker():
    """A Runner actor whose streaming ``run`` starts a Victim actor, yields its PID, then kills it
    while waiting on it, as a verl worker dies under the task runner (defined in a function, so Ray
    ships both classes by value)."""

    @ray.remote(num_cpus=0)
    class Victim:
        def pid(self):
            return os.getpid()

        def wait(self):
            import time

            time.sleep(600)

    @ray.remote(num_cpus=0)
    class Runner:
        def run(self):
            victim = Victim.remote()
            pid = ray.get(victim.pid.remote())
            pending = victim.wait.remote()
            yield pid
            os.kill(pid, signal.SIGKILL)
            yield ray.get(pending)

    return Runner


@pytest.mark.ray
def test_a_killed_actor_inside_the_task_runner_reads_as_a_dead_ray_worker():
    """What the driver gets when a worker the task runner waits on is killed: Ray's error, wrapped
    by the runner's streaming call, explained as a dead worker naming the killed actor."""
    # Ray through ``ray start`` and the cluster helper, which starts it again when Ray's own start-up
    # waits run out on a loaded machine (an in-process ray.init fails there with Ray's start-up timeout).
    with RayCluster() as cluster:
        cluster.start_head(num_cpus=2)
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            with pytest.raises(RayWorkerDied) as died:
                with ray_failures_explained():
                    for ref in runner_killing_its_worker().remote().run.options(num_returns="streaming").remote():
                        pid = ray.get(ref)
        finally:
            ray.shutdown()
    assert isinstance(died.value.__cause__, ray_exceptions.RayTaskError)  # the original is kept
    assert one_line(died.value).startswith(f"a Ray worker process died: actor Victim (pid {pid}, node ")


def _http_server():
    """A plain HTTP/1 server on 127.0.0.1 (as Ray's dashboard is), serving in a daemon thread."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_an_address_ray_cannot_join_is_refused_in_bounded_time_naming_it(monkeypatch):
    """A URL (the dashboard's http://...:8265), a port where nothing listens, one where an HTTP server
    listens, and one that accepts and never answers: each a RayUnreachable naming the address, within
    the connect timeout, where Ray would raise ValueError or retry for minutes."""
    import socket

    from agl_backend_verl.ray_cluster import check_reachable, start_or_join

    server = _http_server()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        cases = {
            "http://127.0.0.1:8265": "is not a Ray cluster's address: Ray joins HOST:PORT of its head's GCS",
            f"127.0.0.1:{free_port()}": "no Ray cluster answers at",
            f"127.0.0.1:{server.server_address[1]}": "but it is not a Ray cluster's GCS",
            f"127.0.0.1:{silent.getsockname()[1]}": "within 0.5 s: timed out",
        }
        for address, said in cases.items():
            with pytest.raises(RayUnreachable, match=said) as raised:
                check_reachable(address, timeout=0.5)
            assert address in one_line(raised.value)
        monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")  # from the environment, as Ray reads it
        with pytest.raises(RayUnreachable, match="http://127.0.0.1:8265"):
            start_or_join({}, connect_timeout=0.5)
        assert not ray.is_initialized()
    finally:
        server.shutdown()
        silent.close()


MICRO_BATCH_KEYS = ("actor.ppo", "rollout.log_prob", "ref.log_prob")


def test_agl_check_checks_the_configured_ray_address(tmp_path, capsys, monkeypatch):
    from agl_backend_verl.cpu import CPU_KEYS

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = str(write_config(tmp_path, backend="torch"))
    micro = [
        f"actor_rollout_ref.{k}_micro_batch_size_per_gpu=1" for k in ("actor.ppo", "rollout.log_prob", "ref.log_prob")
    ]
    agents = "agentlightning.local.agent_class=examples.corridor.agent:CorridorAgent"
    base = ["check", config, "backend=verl", agents, *CPU_KEYS, *micro]
    assert main([*base, f"ray_kwargs.ray_init.address=127.0.0.1:{free_port()}"]) == 2
    assert capsys.readouterr().err.startswith("agl: error: no Ray cluster answers at 127.0.0.1:")
    assert main([*base, "ray_kwargs.ray_init.address=http://127.0.0.1:8265"]) == 2
    assert "config key ray_kwargs.ray_init.address: must be HOST:PORT" in capsys.readouterr().err


def test_the_arguments_that_size_a_new_ray_are_keys_left_out_when_joining(tmp_path, caplog):
    """``ray_kwargs.ray_init._temp_dir`` (and the other sizes of a new Ray) load as keys and reach
    ray.init for a Ray of agl's own; joining a cluster leaves them out, and says so."""
    from agl_backend_verl.config import load_verl_config
    from agl_backend_verl.run import ray_init_kwargs

    config = load_verl_config(None, [f"ray_kwargs.ray_init._temp_dir={tmp_path}", "ray_kwargs.ray_init.num_gpus=0"])
    kwargs = ray_init_kwargs(config)
    assert kwargs["_temp_dir"] == str(tmp_path) and kwargs["num_gpus"] == 0 and "resources" not in kwargs
