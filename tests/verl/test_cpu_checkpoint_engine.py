"""The gloo checkpoint engine of verl's CPU mode (``agl_gloo``): verl's weight-sync protocol between
processes, as ``CheckpointEngineManager.update_weights`` drives it (tests/helpers/gloo_checkpoint_engine.py).
"""

from __future__ import annotations

import multiprocessing
import pickle

import pytest
import torch

pytestmark = pytest.mark.verl

pytest.importorskip("verl")

from verl.checkpoint_engine import CheckpointEngineRegistry  # noqa: E402

from agl_backend_verl.cpu import checkpoint_engine  # noqa: E402
from agl_backend_verl.cpu.checkpoint_engine import BACKEND, GlooCheckpointEngine, Rendezvous  # noqa: E402
from tests.helpers.gloo_checkpoint_engine import play, weights  # noqa: E402

ROLES = ("source", "drain", "receiver", "receiver")  # actor ranks 0 and 1, a replica of two rollout workers
VERSIONS = [1, 2]  # two updates in a row: each builds its own group and drops it
# A bound on a hang, not a timing: four spawned processes import torch and verl first, which takes
# minutes on a loaded 2-core machine.
HANG_S = 1200.0


def test_it_is_verls_checkpoint_engine_agl_gloo():
    checkpoint_engine.register()
    assert CheckpointEngineRegistry.get(BACKEND) is GlooCheckpointEngine
    engine = CheckpointEngineRegistry.new(BACKEND, bucket_size=1 << 20, is_master=False)  # as verl builds it
    assert engine.prepare() is None  # only the source hosts the rendezvous


def test_the_topology_puts_the_source_first_the_rollout_workers_after_and_other_actor_ranks_out():
    actor, rollout = GlooCheckpointEngine.build_topology(3, 2, [Rendezvous("10.0.0.1", 7), None, None, None, None])
    assert actor["rank"] == [0, -1, -1] and rollout["rank"] == [1, 2]
    assert set(actor["world_size"] + rollout["world_size"]) == {3}
    assert set(actor["rendezvous"] + rollout["rendezvous"]) == {Rendezvous("10.0.0.1", 7)}
    with pytest.raises(ValueError, match="actor rank 0 must be"):
        GlooCheckpointEngine.build_topology(1, 1, [None, None])


@pytest.mark.slow
def test_two_updates_reach_every_rollout_worker_equal_over_gloo():
    """Four processes (the source, a draining actor rank, two rollout workers), two updates: every
    receiver gets each version's tensors equal in name, order, dtype, shape and value, and the
    draining rank walks its whole generator (FSDP's gathers are collective)."""
    spawn = multiprocessing.get_context("spawn")
    inboxes = [spawn.Queue() for _ in ROLES]
    outboxes = [spawn.Queue() for _ in ROLES]
    processes = [
        spawn.Process(target=play, args=(role, VERSIONS, inbox, out), daemon=True)
        for role, inbox, out in zip(ROLES, inboxes, outboxes)
    ]
    for process in processes:
        process.start()
    try:
        for version in VERSIONS:
            prepared = [_expect(out, "prepared") for out in outboxes]
            actor, rollout = GlooCheckpointEngine.build_topology(2, 2, prepared)
            for i, inbox in enumerate(inboxes):
                side, index = (actor, i) if i < 2 else (rollout, i - 2)
                inbox.put({key: values[index] for key, values in side.items()})
            reports = [_expect(out, "sent" if role != "receiver" else "received") for role, out in zip(ROLES, outboxes)]
            want = weights(version)
            assert reports[0] == reports[1] == list(want)  # both actor ranks walked every tensor
            for received in map(pickle.loads, reports[2:]):
                assert [name for name, _ in received] == list(want)
                for name, tensor in received:
                    assert tensor.dtype == want[name].dtype and tensor.shape == want[name].shape, name
                    assert torch.equal(tensor, want[name]), name
        for process in processes:
            process.join(timeout=HANG_S)
            assert process.exitcode == 0
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()


def _expect(box, kind: str, timeout: float = HANG_S):
    got, value = box.get(timeout=timeout)
    assert got == kind, (got, value)
    return value
