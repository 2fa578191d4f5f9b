"""A run's code reaches the Ray processes of a node that does not have it, and a lost node reads as
Ray's failure: a real cluster of two nodes on 127.0.0.1 (``tests/helpers/ray_cluster.py``).

The worker node runs with its own working directory and a ``PYTHONPATH`` without this checkout, and
the hook file and the entry-point plugin exist only in a temporary folder of the driver's: an actor
Ray places on the worker node imports them only if the run shipped them (``agl_backend_verl.shipping``).
"""

from __future__ import annotations

import os
import sys

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.ray, pytest.mark.slow]

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

from agl_backend_verl.config import load_verl_config  # noqa: E402
from agl_backend_verl.ray_cluster import start_or_join  # noqa: E402
from agl_backend_verl.ray_errors import RayFailure, ray_failures_explained  # noqa: E402
from agl_backend_verl.run import ray_init_kwargs  # noqa: E402
from agl_core.plugins import DISABLE_AUTOLOAD_ENV  # noqa: E402
from tests.helpers.paths import REPO_ROOT  # noqa: E402
from tests.helpers.ray_cluster import RayCluster  # noqa: E402
from tests.helpers.shipped_plugins import write_head_only_plugins  # noqa: E402

HEAD, WORKER = "agl_test_head_node", "agl_test_worker_node"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("worker-node-cwd")
    with RayCluster(env={DISABLE_AUTOLOAD_ENV: "0"}) as cluster:
        cluster.start_head(num_cpus=2, resources={HEAD: 1})
        cluster.add_worker(num_cpus=2, resources={WORKER: 1}, cwd=elsewhere, env={"PYTHONPATH": str(elsewhere)})
        yield cluster
    assert not any(node.alive() for node in (cluster.head, *cluster.workers)), "a node outlived the cluster"


@pytest.fixture(scope="module")
def joined(cluster, tmp_path_factory):
    """The driver joined to the cluster as ``agl train`` joins it, with a hook file, an entry-point
    plugin and plugin settings that only this process's folders hold."""
    head_only = write_head_only_plugins(tmp_path_factory.mktemp("head-only"))
    saved_path, saved_flag, saved_cwd = list(sys.path), os.environ.pop(DISABLE_AUTOLOAD_ENV, None), os.getcwd()
    sys.path.insert(0, str(head_only.site))
    # Ray puts the driver's working directory on every worker's path: a checkout there would be imported
    # on this one-machine cluster whatever was shipped (on another machine the path holds nothing of it).
    os.chdir(tmp_path_factory.mktemp("driver-cwd"))
    config = load_verl_config(
        None,
        [
            f"agentlightning.hooks={head_only.hook_file}",
            "agentlightning.plugins.probe.greeting=bonjour",
            "agentlightning.verl.replica_bind_host=0.0.0.0",
            f"ray_kwargs.ray_init.address={cluster.address}",
            "ray_kwargs.ray_init.num_cpus=12",  # a new Ray's size: left out when joining
        ],
    )
    try:
        start_or_join(ray_init_kwargs(config), connect_timeout=10.0)
        yield config, head_only
    finally:
        ray.shutdown()
        os.chdir(saved_cwd)
        sys.path[:] = saved_path
        if saved_flag is not None:
            os.environ[DISABLE_AUTOLOAD_ENV] = saved_flag


def worker_node_id() -> str:
    (node,) = [n for n in ray.nodes() if n["Alive"] and WORKER in n["Resources"]]
    return node["NodeID"]


def test_the_driver_joined_both_nodes_without_sizing_a_new_ray(joined):
    alive = [node for node in ray.nodes() if node["Alive"]]
    assert len(alive) == 2
    assert ray.cluster_resources()["CPU"] == 4  # the nodes' own 2 + 2, not num_cpus=12


def test_hook_files_entry_point_plugins_and_their_settings_reach_the_worker_node(joined):
    config, head_only = joined

    @ray.remote(num_cpus=0, resources={WORKER: 0.1})
    def report(config):
        import os

        import ray

        import agl_core
        from agl_backend_verl.replica_address import advertised_address
        from agl_backend_verl.shipping import localized_hook_files
        from agl_core import PluginManager

        localized = localized_hook_files(config)
        manager = PluginManager.from_config(localized)
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "cwd": os.getcwd(),
            "agl_core": agl_core.__file__,
            "hooks": list(localized.agentlightning.hooks),
            "plugins": {info.name: info.source for info in manager.list_plugins()},
            "greeting": manager.aggregators.entry("probe_agg").obj.greeting,
            "estimators": manager.advantage_estimators.names(),
            "advertised": advertised_address(1234),
        }

    got = ray.get(report.remote(config))
    print(f"\nreport from the worker node: {got}")
    assert got["node"] == worker_node_id()
    assert not got["cwd"].startswith(str(REPO_ROOT))
    # agl itself is the driver's copy, shipped: first on the worker's path, whatever the node has installed
    assert "runtime_resources" in got["agl_core"] and not got["agl_core"].startswith(str(REPO_ROOT))
    assert got["plugins"]["probe"] == "entry point (probe-plugin 0.1)"
    assert got["greeting"] == "bonjour"  # the run's plugin settings, not the default
    (hook,) = got["hooks"]
    assert hook != str(head_only.hook_file) and hook.endswith("/probe_hooks.py") and "runtime_resources" in hook
    assert f"hookfile:{hook}" in got["plugins"]
    assert "probe_estimator" in got["estimators"]  # registered through the helper beside the hook file
    host, _, port = got["advertised"].rpartition(":")
    assert port == "1234" and host not in ("0.0.0.0", "")  # a wildcard bind advertises the node's address


def test_verls_workers_on_the_worker_node_register_agls_losses(joined):
    """verl imports agl's plugin module in its workers (the ``verl.plugins`` entry point and
    ``VERL_USE_EXTERNAL_MODULES``): the shipped copy, with the driver's plugin settings."""

    @ray.remote(num_cpus=0, resources={WORKER: 0.1})
    def registered():
        import os

        import verl  # noqa: F401  (loads the verl.plugins entry points, as in every verl worker)
        from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

        from agl_backend_verl import verl_plugins

        return verl_plugins.__file__, "per_rollout_mean" in POLICY_LOSS_REGISTRY, os.environ.get("AGL_PLUGIN_SETTINGS")

    path, has_loss, settings = ray.get(registered.remote())
    assert "runtime_resources" in path and has_loss
    assert '"greeting": "bonjour"' in settings


def test_an_actor_on_a_lost_node_reads_as_rays_failure(cluster, joined):
    """Last: the worker node is killed (by its process group's PID) while an actor there is busy."""

    @ray.remote(num_cpus=0, resources={WORKER: 0.1})
    class Busy:
        def wait(self):
            import time

            time.sleep(600)

    busy = Busy.remote()
    ray.get(busy.__ray_ready__.remote())  # created on the worker node
    pending = busy.wait.remote()
    cluster.workers[0].kill()
    with pytest.raises(RayFailure) as lost:
        with ray_failures_explained():
            ray.get(pending)
    message = str(lost.value)
    print(f"\nafter the worker node was killed: agl: error: {message}\nagl: hint: {lost.value.hint}")
    assert "\n" not in message and "Ray" in message
    assert lost.value.hint and "trainer.resume_mode=auto" in lost.value.hint
