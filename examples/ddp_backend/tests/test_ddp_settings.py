"""What ddp refuses, naming the key; uneven micro-batches over its processes."""

from concurrent.futures import ThreadPoolExecutor

import agl_ddp_backend
import pytest
import torch

from agl_core import ConfigError, PluginManager, TrainingRow, load_config, tensorize
from agl_core.backends.ppo import take_rows
from agl_core.testing.harness import tiny_policy

AGENT = "agentlightning.local.agent_class=agl_core.testing.tiny_task:TinyWordAgent"


def backend(*overrides):
    config = load_config(overrides=[f"actor_rollout_ref.model.path={tiny_policy()}", AGENT, *overrides])
    manager = PluginManager(load_entrypoints=False)
    manager.register(agl_ddp_backend)
    manager.configure(config)
    return agl_ddp_backend.DdpBackend(config, manager)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.use_kl_loss"),
        ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_rank"),
        ("actor_rollout_ref.actor.optim.lr_warmup_steps=3", "actor_rollout_ref.actor.optim.lr_warmup_steps"),
    ],
)
def test_what_it_does_not_implement_is_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        agl_ddp_backend.check_ddp_config(load_config(overrides=[override]))
    assert info.value.key == key


def test_more_processes_than_rows_in_a_mini_batch_are_refused(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": 0}\n')
    with pytest.raises(ConfigError, match=r"agentlightning\.plugins\.ddp\.processes.*is 3, more than the 2 rows"):
        backend(
            f"data.train_files={rows}",
            "data.train_batch_size=1",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "agentlightning.plugins.ddp.processes=3",
        )


def test_uneven_micro_batches_over_two_processes_make_the_one_process_update(tmp_path):
    """Three rows over two processes in micro-batches of one: rank 0 runs two forward-backward passes,
    rank 1 one. DDP averages the gradients in each rank's last pass only (``no_sync`` before), so the
    ranks meet once per step instead of waiting for each other (the hang), and the update is the
    one-process update of the three rows."""
    rows = [
        TrainingRow(
            prompt_ids=[5, 6, 7][: 1 + i],
            response_ids=[8, 9, 10, 11][: 2 + i],
            response_mask=[1] * (2 + i),
            reward=float(i),
            rollout_id=f"r{i}",
            group_id="g",
        )
        for i in range(3)
    ]
    tensors = take_rows(tensorize(rows, pad_token_id=0).tensors, slice(None))
    advantages = torch.tensor([1.0, -0.5, 0.25])[:, None] * tensors["response_mask"]
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text('{"id": 0}\n')
    updates = {}
    for processes in (1, 2):
        ddp = backend(
            f"data.train_files={dataset}",
            "data.train_batch_size=1",
            f"agentlightning.plugins.ddp.processes={processes}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.rollout.n=3",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.optim.lr=1e-2",
        )
        pool = ThreadPoolExecutor(1)
        try:
            updates[processes] = pool.submit(ddp._call, "update", tensors, advantages, 1).result(timeout=120)
        finally:
            ddp.close()  # a hung rank is killed, which ends the call
            pool.shutdown(wait=False)
    (one, one_weights), (two, two_weights) = updates[1], updates[2]
    assert one["actor/n_micro_batches"] == 3.0 and two["actor/n_micro_batches"] == 2.0  # rank 0's passes
    assert two["actor/pg_loss"] == pytest.approx(one["actor/pg_loss"], rel=1e-5, abs=1e-7)
    for name, weight in one_weights.items():
        torch.testing.assert_close(two_weights[name], weight, rtol=1e-5, atol=1e-6)
