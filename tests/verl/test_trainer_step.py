"""The verl trainer's loop on CPU: the real ``RayPPOTrainer`` subclass, real verl code and agl stages,
with only the GPU-only worker calls (:class:`~agl_backend_verl.worker_calls.WorkerCalls`) faked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.verl

pytest.importorskip("verl")

from verl import DataProto  # noqa: E402
from verl.trainer.ppo.ray_trainer import Role  # noqa: E402

from agl_backend_verl.config import load_verl_config  # noqa: E402
from agl_backend_verl.trainer import AglRayPPOTrainer, SampleDataset, collate_samples  # noqa: E402
from agl_core.config import ConfigError  # noqa: E402
from agl_core.data import CompletedRollout, Triplet  # noqa: E402
from agl_core.plugins import PluginManager  # noqa: E402
from agl_core.rollouts.source import RolloutBatch, make_requests  # noqa: E402
from tests.helpers.verl_fake_workers import FakeWorkers  # noqa: E402

N = 4


class FakeSource:
    """A rollout source whose agents answer at once: each rollout makes two model calls (the second
    continues the first, so they merge) and earns ``sample["target"]`` minus its index."""

    def __init__(self, config, plugins):
        self.config, self.plugins = config, plugins
        self.registered: list[tuple[list[str], int]] = []
        self.collected: list[tuple[int, bool, int]] = []
        self.rng = np.random.default_rng(0)

    def collect(self, samples, *, step, is_train):
        groups = make_requests(samples, n=N, step=step, is_train=is_train, rollout_config={}, plugins=self.plugins)
        self.collected.append((step, is_train, len(samples)))
        rollouts = []
        for group in groups:
            for k, request in enumerate(group):
                prompt = self.rng.integers(3, 60, 5)
                first = self.rng.integers(3, 60, 4)
                observation = self.rng.integers(3, 60, 2)
                second = self.rng.integers(3, 60, 3)
                triplets = [
                    Triplet(prompt_ids=prompt, response_ids=first, response_log_probs=-self.rng.random(4)),
                    Triplet(
                        prompt_ids=np.concatenate([prompt, first, observation]),
                        response_ids=second,
                        response_log_probs=-self.rng.random(3),
                    ),
                ]
                rollouts.append(
                    CompletedRollout(
                        rollout_id=request.rollout_id,
                        group_id=request.group_id,
                        state="succeeded",
                        triplets=triplets,
                        final_reward=float(request.input["target"]) - k,
                        step=step,
                        is_train=is_train,
                    )
                )
        return RolloutBatch(rollouts, {"training/fake_source/n_collects": 1.0})

    def before_weight_update(self):
        return {}

    def after_weight_update(self, endpoints, version):
        self.registered.append((list(endpoints), version))

    def state(self):
        return None  # a sync source carries nothing across steps

    def close(self):
        pass


@pytest.fixture
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def make_trainer(tokenizer, *overrides, estimator=None):
    config = load_verl_config(
        None,
        [
            "data.train_batch_size=2",
            "data.val_batch_size=2",
            "data.shuffle=false",
            "data.dataloader_num_workers=0",
            f"actor_rollout_ref.rollout.n={N}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.model.path=/models/tiny",
            "trainer.total_training_steps=2",
            "trainer.test_freq=2",
            "trainer.save_freq=1",
            "trainer.logger=[console]",
            "trainer.device=cpu",
            "agentlightning.agl_base_url=http://127.0.0.1:1",
            *overrides,
        ],
    )
    if estimator is not None:  # a config that did not come through load_verl_config
        config.algorithm.adv_estimator = estimator
    plugins = PluginManager(load_entrypoints=False)
    train = SampleDataset([{"target": t} for t in (1, 2, 3, 4, 5, 6)], "train_dataset")
    val = SampleDataset([{"target": t} for t in (10, 20, 30, 40, 50)], "val_dataset")
    workers = FakeWorkers(config)
    source = FakeSource(config, plugins)
    trainer = AglRayPPOTrainer(
        config=config,
        tokenizer=tokenizer,
        role_worker_mapping={Role.ActorRollout: object},
        resource_pool_manager=None,
        train_dataset=train,
        val_dataset=val,
        collate_fn=collate_samples,
        plugins=plugins,
        rollout_source=source,
        worker_calls=workers,
    )
    return trainer, workers, source


def test_fit_runs_every_stage_in_order(tokenizer):
    trainer, workers, source = make_trainer(tokenizer)
    seen = []
    trainer.fit(on_step=lambda step, total, metrics, samples: seen.append((step, total, dict(metrics), samples)))

    # weights pushed and replicas registered with version = step, first for step 0
    assert [v for _, v in source.registered] == [0, 1, 2]
    assert all(endpoints == workers.rollout_endpoints() for endpoints, _ in source.registered)
    step_calls = workers.calls[workers.calls.index(("push", 0)) :]
    first_step = step_calls[step_calls.index(("resume",), 3) :]  # after the initial validation
    names = [c[0] for c in first_step]
    assert names[:7] == ["resume", "abort", "sleep", "dp_size", "old_log_probs", "update_actor", "push"]
    assert ("save",) in workers.calls and workers.calls.count(("save",)) == 2

    # validation before training and at test_freq: all 5 validation samples over 3 batches
    val_collects = [c for c in source.collected if not c[1]]
    assert [c[2] for c in val_collects] == [2, 2, 1, 2, 2, 1]
    step2 = seen[-1][2]
    assert step2["val/n_rollouts"] == 5
    assert step2["val/reward"] == pytest.approx(30.0)
    assert [s for s, *_ in seen] == [0, 1, 2]  # step 0: the validation before training
    assert seen[0][2]["val/n_rollouts"] == 5

    # the trained batch: whole rollouts, a whole number of mini-batches, float32 scores
    metrics = seen[1][2]
    assert metrics["training/n_rollouts"] == 2 * N
    assert metrics["training/n_sample_trained"] % N == 0
    batch = workers.updated[0]
    assert batch.batch["token_level_scores"].dtype.__str__() == "torch.float32"
    assert set(batch.non_tensor_batch["rollout_ids"]) and len(batch) == metrics["training/n_sample_trained"]
    assert "actor/pg_clipfrac" in metrics and "actor/ppo_kl" in metrics
    assert (metrics["training/global_step"], metrics["training/epoch"]) == (1.0, 0.0)

    # each training step's sample tables stream with it: the step's decoded rollouts, in dataset order
    assert seen[0][3] == {}  # validation only
    trajectories = seen[1][3]["trajectories"]
    assert len(trajectories) == 2 * N and {row["step"] for row in trajectories} == {1}
    assert [row["reward"] for row in trajectories[:N]] == [1.0, 0.0, -1.0, -2.0]  # sample 0: target 1 minus k
    assert all(row["n_calls"] == 2 and row["prompt"] and row["response"] for row in trajectories)


def test_advantages_are_normalised_per_rollout_before_the_update(tokenizer):
    trainer, workers, _ = make_trainer(tokenizer, "trainer.val_before_train=false", "trainer.test_freq=-1")
    trainer.fit()
    batch = workers.updated[0]
    advantages = batch.batch["advantages"]
    mask = batch.batch["response_mask"].bool()
    rollout_ids = list(batch.non_tensor_batch["rollout_ids"])
    n_rollouts = len(set(rollout_ids))
    n_mini = len(batch) // N
    returns = batch.batch["returns"]  # in the batch as Agent Lightning v1.0 puts them, critic or not
    # per_rollout_mean with 'rollouts' normalisation: each rollout's scale sums to M / R over its tokens;
    # the returns are one unscaled value per rollout
    for rid in set(rollout_ids):
        rows = [i for i, r in enumerate(rollout_ids) if r == rid]
        tokens = int(mask[rows].sum())
        values = advantages[rows][mask[rows]]
        assert values.abs().sum() == pytest.approx(abs(float(values[0])) * tokens, rel=1e-5)
        assert returns[rows][mask[rows]].unique().numel() == 1 and not returns[rows][~mask[rows]].any()
        torch.testing.assert_close(advantages[rows], returns[rows] * n_mini / (tokens * n_rollouts))
    grpo_like = [
        float(advantages[i][mask[i]][0])
        * int(mask[[j for j, r in enumerate(rollout_ids) if r == rollout_ids[i]]].sum())
        * n_rollouts
        / n_mini
        for i in range(len(batch))
    ]
    # undoing the scale gives verl's grpo on rewards target - k (k = 0..3): (1.5 - k) / std([0, 1, 2, 3])
    expected = {round((1.5 - k) / (np.std([0, 1, 2, 3], ddof=1) + 1e-6), 3) for k in range(N)}
    assert {round(v, 3) for v in grpo_like} <= expected
    assert len({round(v, 3) for v in grpo_like}) >= 2


def test_remax_is_rejected_with_a_clear_error(tokenizer):
    with pytest.raises(ConfigError, match="REMAX"):
        make_trainer(tokenizer, estimator="remax")


class CriticFakeWorkers(FakeWorkers):
    """The fake workers with a critic: ``values`` from the batch's scores (a value per token, so that
    gae's advantages differ from its returns), the critic update's loss computed by verl's value loss."""

    def values(self, batch):
        self.calls.append(("values", len(batch)))
        values = 0.1 * torch.cumsum(batch.batch["response_mask"].float(), dim=-1) * batch.batch["response_mask"]
        return DataProto.from_dict(tensors={"values": values})

    def update_critic(self, batch):
        from verl.trainer.ppo.core_algos import compute_value_loss

        self.calls.append(("update_critic", len(batch)))
        self.critic_batch = batch
        loss, clipfrac = compute_value_loss(
            batch.batch["values"] + 0.01,
            batch.batch["values"],
            batch.batch["returns"],
            batch.batch["response_mask"],
            0.5,
        )
        return {"critic/vf_loss": [float(loss)], "critic/vf_clipfrac": [float(clipfrac)]}


def test_gae_trains_the_critic_on_advantages_from_its_values(tokenizer):
    """Under gae the critic's values come before the advantages (verl's order: values, advantages,
    critic update, actor update), and the actor trains on verl's gae advantages of those values."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    trainer, _, _ = make_trainer(
        tokenizer,
        "algorithm.adv_estimator=gae",
        "algorithm.enable_rollout_level_advantage=false",
        "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.total_training_steps=1",
    )
    workers = trainer.calls = CriticFakeWorkers(trainer.config)
    assert trainer.use_critic
    seen = []
    trainer.fit(on_step=lambda step, total, metrics, samples: seen.append(metrics))
    names = [c[0] for c in workers.calls]
    assert names.index("values") < names.index("update_critic") < names.index("update_actor")
    batch = workers.updated[0]
    mask = batch.batch["response_mask"]
    want_adv, want_ret = compute_gae_advantage_return(
        batch.batch["token_level_rewards"],
        batch.batch["values"],
        mask,
        trainer.config.algorithm.gamma,
        trainer.config.algorithm.lam,
    )
    torch.testing.assert_close(batch.batch["advantages"], want_adv)
    torch.testing.assert_close(batch.batch["returns"], want_ret)
    assert batch.batch["advantages"][mask.bool()].abs().sum() > 0
    assert workers.critic_batch.batch["returns"] is batch.batch["returns"]
    metrics = seen[-1]
    assert np.isfinite(metrics["critic/vf_loss"]) and metrics["critic/vf_loss"] > 0


def test_gae_without_the_critic_is_rejected(tokenizer):
    with pytest.raises(ConfigError, match="critic.enable"):
        make_trainer(
            tokenizer,
            "algorithm.adv_estimator=gae",
            "algorithm.enable_rollout_level_advantage=false",
            "critic.enable=false",
        )


def test_on_two_ranks_verls_dispatch_gets_the_torch_backends_mini_batches(tokenizer):
    """verl hands each rank a contiguous share of the batch and cuts it into mini-batches; the trainer
    orders the rows so that, across both ranks, mini-batch ``i`` is the shaped batch's ``i``-th slice."""
    trainer, _, _ = make_trainer(
        tokenizer, "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.total_training_steps=1"
    )
    workers = trainer.calls = FakeWorkers(trainer.config, dp_size=2)
    prepared = []
    prepare = trainer.pipeline.prepare
    trainer.pipeline.prepare = lambda rollouts, step: prepared.append(prepare(rollouts, step)) or prepared[-1]
    seen = []
    trainer.fit(on_step=lambda step, total, metrics, samples: seen.append(metrics))
    shaped = prepared[0].shaped
    assert shaped.n_mini_batches == 2
    per_mini, share = len(shaped.rows) // 2, len(shaped.rows) // 2
    part = per_mini // 2
    trained = list(workers.updated[0].non_tensor_batch["rollout_ids"])
    for i in range(shaped.n_mini_batches):
        verls = sorted(trained[r * share + i * part + j] for r in range(2) for j in range(part))
        torchs = sorted(row.rollout_id for row in shaped.rows[i * per_mini : (i + 1) * per_mini])
        assert verls == torchs
    assert "global_seqlen/balanced_max" in seen[-1]  # trainer.balance_batch: balanced within each mini-batch
