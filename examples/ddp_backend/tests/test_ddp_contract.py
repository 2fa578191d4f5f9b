"""ddp keeps every promise agl asks of a backend (the shipped contract suite, on its default recording:
three steps of the tiny task, recorded with the reference backend). Each rank's share of a mini-batch
is cut into micro-batches of one row (``ppo_micro_batch_size_per_gpu``, the reference's too), so the
update is the sum of its micro-batches' and ranks' gradients, which must still equal the reference's."""

import agl_ddp_backend

from agl_core.testing.contracts import BackendContract


class TestDdpBackendContract(BackendContract):
    backend_name = "ddp"
    plugins = (agl_ddp_backend,)
    overrides = ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",)
