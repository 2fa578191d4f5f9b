"""The verl backend on a Ray cluster of two nodes on this machine (``tests/helpers/ray_cluster.py``).

:func:`two_node_cluster` starts the head and one worker node, each offering one CPU rank
(``verl_cpu_rank``) and CPUs for verl's placement groups; the worker node runs from its own folder
with its own ``PYTHONPATH``, so only what the run ships reaches it. :func:`two_node_keys` joins a run
to it (``trainer.nnodes=2``, one rank per node), so :func:`tests.helpers.verl_e2e.scenario` runs
there; :func:`ranks_on_both_nodes` checks where Ray placed the ranks, and :func:`node_lost_scenario`
loses the worker node mid-step and resumes on the cluster made whole again. ``device_keys`` and
``overrides`` come last, so a backend or device can change anything (another trainer, the GPU keys).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

from agl_backend_verl.cpu.mode import RANK_RESOURCE
from tests.helpers.ray_cluster import RayCluster
from tests.helpers.verl_e2e import ASYNC_KEYS, Stack, Train, check_rows, report_lines, rows

HEAD, WORKER = "agl_test_head_node", "agl_test_worker_node"
CPUS_PER_NODE = 6  # verl's placement groups take 3 CPUs per rank; the task runner and helpers the rest
RANK_ACTOR = "WorkerDict"  # verl's colocated rank actor


@contextmanager
def two_node_cluster(work: Path):
    """A head and a worker node, one ``verl_cpu_rank`` each; stopped by PID on exit."""
    with RayCluster() as cluster:
        cluster.start_head(CPUS_PER_NODE, {RANK_RESOURCE: 1, HEAD: 1})
        add_worker_node(cluster, work / "worker-node-cwd")
        yield cluster


def add_worker_node(cluster: RayCluster, cwd: Path) -> None:
    """The worker node: one rank, running from its own folder ``cwd`` with an empty ``PYTHONPATH``."""
    cwd.mkdir(parents=True, exist_ok=True)
    cluster.add_worker(CPUS_PER_NODE, {RANK_RESOURCE: 1, WORKER: 1}, cwd=cwd, env={"PYTHONPATH": ""})


def two_node_keys(cluster: RayCluster) -> tuple[str, ...]:
    """Join ``cluster``, one rank on each of its two nodes, the replica reachable from other nodes."""
    return (
        f"ray_kwargs.ray_init.address={cluster.address}",
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",  # a replica per rank: one on each node
        "agentlightning.verl.replica_bind_host=0.0.0.0",
    )


def placement(cluster: RayCluster) -> Counter[tuple[str, str]]:
    """How many actors of each class ran on each node (``head``/``worker``), from the cluster's GCS."""
    import ray

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        names = {node["NodeID"]: ("head" if HEAD in node["Resources"] else "worker") for node in ray.nodes()}
        actors = ray._private.state.actors().values()  # the GCS's actor table, dead actors included
        return Counter((names.get(a["Address"]["NodeID"], "?"), a["ActorClassName"]) for a in actors)
    finally:
        ray.shutdown()


def ranks_on_both_nodes(cluster: RayCluster) -> tuple[list[str], list[str]]:
    """Where Ray ran every actor of the runs so far, and what is wrong with it: one rank resource on
    each node, so verl's ranks must use both (the CPU replica's server is not pinned to its ranks'
    node): ``(problems, report lines)``."""
    where = placement(cluster)
    lines = [f"  actors by node: {dict(sorted(where.items()))}"]
    problems = [
        f"no verl rank ({RANK_ACTOR}) ran on the {node} node: {dict(where)}"
        for node in ("head", "worker")
        if not any(count for (at, name), count in where.items() if at == node and name.endswith(RANK_ACTOR))
    ]
    return problems, lines


NODE_LOST_KEYS = (
    # A rollout whose agent waits on a lost replica ends within this, so a lost node cannot hang the step.
    "agentlightning.rollout_timeout_seconds=300",
    # TransferQueue's storage on the node that stays: a unit lost with its node answers nothing until
    # TransferQueue's own timeouts run out (200 s, 3 attempts), and the data it held is gone.
    f"transfer_queue.backend.SimpleStorage.required_node_resource={HEAD}",
)


def node_lost_scenario(
    stack: Stack, cluster: RayCluster, device_keys: Sequence[str], *overrides: str, timeout: float = 3600.0
) -> tuple[list[str], list[str]]:
    """Async steps on the two nodes; the worker node is killed (by its processes' PIDs) once step 1 is
    reported and checkpointed, while step 2's groups run. The run must end by itself with one
    ``agl: error:`` line naming Ray and what was lost; on a cluster made whole again (a new worker
    node) the run resumed from step 1's checkpoint trains steps 2 and 3, each once, with the groups
    that were in flight resumed or re-created, counted and trained (no rollout of the first resumed
    step fails: the proxy the lost run left paused is resumed): ``(problems, report lines)``."""
    run_dir = stack.work / "node-lost-run"
    keys = (*device_keys, *two_node_keys(cluster), *ASYNC_KEYS, *NODE_LOST_KEYS, *overrides)
    lines: list[str] = []
    problems: list[str] = []
    started = time.perf_counter()
    run = Train(stack, run_dir, 3, keys, name="node-lost", n_gpus=1)
    run.wait_for_step(1, timeout)
    cluster.workers[-1].kill()
    code = run.exit_code(timeout)
    errors = [line for line in run.log.read_text(errors="replace").splitlines() if line.startswith("agl: ")]
    lines.append(f"the worker node killed after step 1: exit {code} after {time.perf_counter() - started:.0f}s")
    lines += [f"  {line}" for line in errors]
    if code == 0:
        problems.append("the run finished although its worker node was lost")
    if not any(line.startswith("agl: error:") and "Ray" in line for line in errors):
        problems.append(f"the run did not end with agl's error naming Ray:\n{run.failure()}")
    add_worker_node(cluster, stack.work / "worker-node-cwd-again")
    started = time.perf_counter()
    Train(stack, run_dir, 3, keys, name="node-lost-resumed", n_gpus=1).finish(timeout)
    every = rows(run_dir)
    steps = [row["step"] for row in every]
    if steps != [1, 2, 3]:
        problems.append(f"steps reported {steps}: each of 1, 2, 3 once was expected (nothing trained twice)")
    resumed = [row for row in every if row["step"] >= 2]
    lines += report_lines("resumed on the restored cluster", resumed, time.perf_counter() - started)
    problems += check_rows(resumed, [2, 3])
    if (
        resumed
        and resumed[0].get("training/async/n_resumed_groups", 0)
        + resumed[0].get("training/async/n_recreated_groups", 0)
        <= 0
    ):
        problems.append("the resumed step counted no group in flight (resumed or re-created)")
    return problems, lines
