"""agl's step on verl's V1 trainer, on CPU: the class agl runs for ``trainer.v1.trainer_mode=sync``
with verl's own loop and trainer methods (replay-buffer sampling, ``_compute_old_log_prob``,
``_compute_values``, ``_compute_advantage``, ``_update_critic``, ``_update_actor``), agl's rollout loop
and TransferQueue on a local Ray. Only verl's worker groups and replicas are answered in this
process (:mod:`tests.helpers.verl_local_workers`: the tiny policy, verl's ``ppo_loss``), recording
what every call was given."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.ray]

pytest.importorskip("verl")
ray = pytest.importorskip("ray")

from agl_backend_verl.config import load_verl_config  # noqa: E402
from agl_backend_verl.run import v1_config  # noqa: E402
from agl_core import write_dataset  # noqa: E402
from agl_core.config import ConfigError  # noqa: E402
from agl_core.data import CompletedRollout, Triplet  # noqa: E402
from agl_core.plugins import PluginManager  # noqa: E402
from agl_core.rollouts.source import RolloutBatch, make_requests  # noqa: E402
from tests.helpers.verl_local_workers import fit_locally, local_trainer_class, transfer_queue_session  # noqa: E402

N = 4
ENDPOINTS = ["10.0.0.1:8000", "10.0.0.2:8000"]
ONE_STEP = ("trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.total_training_steps=1")


class FakeSource:
    """A rollout source whose agents answer at once: each rollout makes two model calls (the second
    continues the first, so they merge into one row) and earns ``sample["target"]`` minus its index
    (``sample["target"]`` itself when ``sample["same"]``)."""

    def __init__(self, plugins):
        self.plugins = plugins
        self.registered: list[tuple[list[str], int]] = []
        self.collected: list[tuple[int, bool, int]] = []
        self.rng = np.random.default_rng(0)

    def collect(self, samples, *, step, is_train):
        groups = make_requests(samples, n=N, step=step, is_train=is_train, rollout_config={}, plugins=self.plugins)
        self.collected.append((step, is_train, len(samples)))
        rollouts = []
        for group in groups:
            for k, request in enumerate(group):
                prompt, first = self.rng.integers(3, 60, 5), self.rng.integers(3, 60, 4)
                observation, second = self.rng.integers(3, 60, 2), self.rng.integers(3, 60, 3)
                triplets = [
                    Triplet(prompt_ids=prompt, response_ids=first, response_log_probs=-self.rng.random(4)),
                    Triplet(
                        prompt_ids=np.concatenate([prompt, first, observation]),
                        response_ids=second,
                        response_log_probs=-self.rng.random(3),
                    ),
                ]
                target = float(request.input["target"])
                rollouts.append(
                    CompletedRollout(
                        rollout_id=request.rollout_id,
                        group_id=request.group_id,
                        state="succeeded",
                        triplets=triplets,
                        final_reward=target if request.input.get("same") else target - k,
                        step=step,
                        is_train=is_train,
                        sample_index=request.sample_index,
                    )
                )
        return RolloutBatch(rollouts, {"training/fake_source/n_collects": 1.0})

    def before_weight_update(self):
        return {}

    def after_weight_update(self, endpoints, version):
        self.registered.append((list(endpoints), version))

    def state(self):
        return None

    def close(self):
        pass


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def make_config(tmp_path, model_dir, *overrides, train=None):
    train = train or [{"target": t} for t in (1, 2, 3, 4, 5, 6)]
    files = {
        "train": write_dataset(train, tmp_path / "train.jsonl", "train_dataset"),
        "val": write_dataset([{"target": t} for t in (10, 20, 30, 40, 50)], tmp_path / "val.jsonl", "val_dataset"),
    }
    config = load_verl_config(
        None,
        [
            f"data.train_files={files['train']}",
            f"data.val_files={files['val']}",
            "data.train_batch_size=2",
            "data.val_batch_size=2",
            "data.shuffle=false",
            "data.dataloader_num_workers=0",
            f"actor_rollout_ref.rollout.n={N}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            f"actor_rollout_ref.model.path={model_dir}",
            "trainer.total_training_steps=2",
            "trainer.test_freq=2",
            "trainer.save_freq=1",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.device=cpu",
            "agentlightning.agl_base_url=http://127.0.0.1:1",
            *overrides,
        ],
    )
    return v1_config(config)


class Run:
    """One ``fit`` of the trainer agl runs for ``sync`` on local workers: what it reported, its
    workers' records, its source, and the batches its pipeline prepared."""

    def __init__(self, config, *, dp_size=1):
        plugins = PluginManager(load_entrypoints=False)
        self.source = FakeSource(plugins)
        self.prepared = []
        with transfer_queue_session(config):
            self.trainer = local_trainer_class("sync", ENDPOINTS, dp_size=dp_size)(config, plugins=plugins)
            self.trainer.init()
            self.workers = self.trainer.local
            prepare = self.trainer.pipeline.prepare
            self.trainer.pipeline.prepare = lambda rollouts, step: self._keep(prepare(rollouts, step))
            self.reports = fit_locally(self.trainer, self.source, N)

    def _keep(self, prepared):
        self.prepared.append(prepared)
        return prepared

    def updated(self, call=0):
        """What the actor update of step ``call + 1`` got: each rank's rows and extra info."""
        return self.workers.actor.given["update_actor"][call]

    def metrics(self, step):
        return next(metrics for s, _, metrics, _ in self.reports if s == step)


def rows_of(data, *names):
    """The named nested fields of ``data`` as padded tensors (zeros past each row's end)."""
    return [data[name].to_padded_tensor(0) for name in names]


def test_fit_runs_every_stage_in_order(ray_session, tmp_path, tiny_model_dir):
    run = Run(make_config(tmp_path, tiny_model_dir))
    workers, source = run.workers, run.source

    # replicas asleep and loaded at init (version 0), registered with the source after every push
    names = workers.names()
    assert names[:2] == ["sleep_replicas", "update_weights"] and workers.calls[1] == ("update_weights", 0)
    assert [v for _, v in source.registered] == [0, 1, 2]
    assert all(endpoints == [f"http://{e}/v1" for e in ENDPOINTS] for endpoints, _ in source.registered)
    # each step: replicas put to sleep after sampling, old log-probs, the update, verl's checkpoint,
    # then the weights pushed under the step's version
    step_calls = workers.calls[2:]
    assert [c[0] for c in step_calls] == [
        *("sleep_replicas", "compute_log_prob", "update_actor", "save_checkpoint", "update_weights"),
        *("sleep_replicas", "compute_log_prob", "update_actor", "save_checkpoint", "update_weights"),
    ]
    assert [c[1] for c in step_calls if c[0] in ("save_checkpoint", "update_weights")] == [1, 1, 2, 2]
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text() == "2"

    # validation before training and at test_freq: all 5 validation samples over 3 batches
    assert [c[2] for c in source.collected if not c[1]] == [2, 2, 1, 2, 2, 1]
    assert [s for s, *_ in run.reports] == [0, 1, 2]  # step 0: the validation before training
    assert run.metrics(0)["val/n_rollouts"] == 5
    step2 = run.metrics(2)
    assert step2["val/n_rollouts"] == 5 and step2["val/reward"] == pytest.approx(30.0)

    # the trained batch: whole rollouts, a whole number of mini-batches, float32 scores, the rows the
    # pipeline kept and nothing else, in the order verl's dispatch takes them
    metrics = run.metrics(1)
    assert metrics["training/n_rollouts"] == 2 * N
    assert metrics["training/n_sample_trained"] % N == 0
    (given,) = run.updated(0)
    assert len(given.keys) == metrics["training/n_sample_trained"] == len(run.prepared[0].shaped.rows)
    assert given.data["rm_scores"].dtype == torch.float32
    assert "actor/pg_clipfrac" in metrics and "actor/ppo_kl" in metrics and "actor/pg_loss" in metrics
    assert (metrics["training/global_step"], metrics["training/epoch"]) == (1.0, 0.0)
    # the old log-probs verl wrote are the actor's, over the response tokens only
    old, rollout = rows_of(given.data, "old_log_probs", "rollout_log_probs")
    assert old.shape == rollout.shape and not torch.equal(old, rollout)

    # each training step's sample tables stream with it: the step's decoded rollouts
    assert run.reports[0][3] == {}  # validation only
    trajectories = run.reports[1][3]["trajectories"]
    assert len(trajectories) == 2 * N and {row["step"] for row in trajectories} == {1}
    assert sorted(row["reward"] for row in trajectories) == sorted([1.0, 0.0, -1.0, -2.0, 2.0, 1.0, 0.0, -1.0])
    assert all(row["n_calls"] == 2 and row["prompt"] and row["response"] for row in trajectories)


def rollout_rows(keys):
    """Row positions by rollout: a row's key is its rollout record's key, ``_`` and its index."""
    by_rollout = {}
    for i, key in enumerate(keys):
        by_rollout.setdefault(key.rsplit("_", 1)[0], []).append(i)
    return by_rollout


def test_advantages_are_normalised_per_rollout_before_the_update(ray_session, tmp_path, tiny_model_dir):
    config = make_config(tmp_path, tiny_model_dir, *ONE_STEP)
    run = Run(config)
    (given,) = run.updated(0)
    advantages, returns, mask = rows_of(given.data, "advantages", "returns", "response_mask")
    mask = mask.bool()
    by_rollout = rollout_rows(given.keys)
    n_rollouts, n_mini = len(by_rollout), len(given.keys) // N
    assert n_rollouts == 2 * N and n_mini == 2
    # per_rollout_mean with 'rollouts' normalisation: each rollout's scale sums to M / R over its tokens;
    # the returns are one unscaled value per rollout (Agent Lightning v1.0 puts them in the batch)
    grpo_like = []
    for rows in by_rollout.values():
        tokens = int(mask[rows].sum())
        values = advantages[rows][mask[rows]]
        assert values.abs().sum() == pytest.approx(abs(float(values[0])) * tokens, rel=1e-5)
        assert returns[rows][mask[rows]].unique().numel() == 1 and not returns[rows][~mask[rows]].any()
        torch.testing.assert_close(advantages[rows], returns[rows] * n_mini / (tokens * n_rollouts))
        grpo_like.append(float(values[0]) * tokens * n_rollouts / n_mini)
    # undoing the scale gives verl's grpo on rewards target - k (k = 0..3): (1.5 - k) / std([0, 1, 2, 3])
    expected = {round((1.5 - k) / (np.std([0, 1, 2, 3], ddof=1) + 1e-6), 3) for k in range(N)}
    assert {round(v, 3) for v in grpo_like} == expected


def test_a_group_whose_rewards_are_all_equal_is_dropped_first(ray_session, tmp_path, tiny_model_dir):
    """Room for one mini-batch of N rows: the group whose rewards are all equal goes (its advantage is
    zero), the other is trained, and the drop is counted."""
    config = make_config(
        tmp_path,
        tiny_model_dir,
        "agentlightning.max_ppo_update_times=1",
        *ONE_STEP,
        train=[{"target": 3, "same": True}, {"target": 2}],
    )
    run = Run(config)
    metrics = run.metrics(1)
    assert metrics["training/n_sample_dropped/same_reward"] == N and metrics["training/n_sample_dropped/random"] == 0
    assert metrics["training/n_groups"] == 1 and metrics["training/n_zero_adv_groups"] == 0  # of the groups kept
    (given,) = run.updated(0)
    assert len(given.keys) == metrics["training/n_sample_trained"] == N
    (rm_scores,) = rows_of(given.data, "rm_scores")
    assert sorted(float(s) for s in rm_scores.sum(dim=1)) == [-1.0, 0.0, 1.0, 2.0]  # target 2 minus k


def test_remax_is_rejected_with_a_clear_error(tmp_path, tiny_model_dir):
    config = make_config(tmp_path, tiny_model_dir)
    config.algorithm.adv_estimator = "remax"  # a config that did not come through load_verl_config
    with pytest.raises(ConfigError, match="REMAX"):
        local_trainer_class("sync", ENDPOINTS)(config, plugins=PluginManager(load_entrypoints=False))


def test_gae_trains_the_critic_on_advantages_from_its_values(ray_session, tmp_path, tiny_model_dir):
    """Under gae the critic's values come before the advantages (verl's order: values, advantages,
    critic update, actor update), and the actor trains on verl's gae advantages of those values."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    config = make_config(
        tmp_path,
        tiny_model_dir,
        "algorithm.adv_estimator=gae",
        "algorithm.enable_rollout_level_advantage=false",
        "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
        "critic.ppo_micro_batch_size_per_gpu=2",
        f"critic.model.path={tiny_model_dir}",
        *ONE_STEP,
    )
    run = Run(config)
    assert run.trainer.use_critic
    names = run.workers.names()
    assert names.index("compute_log_prob") < names.index("infer_batch") < names.index("train_mini_batch")
    assert names.index("train_mini_batch") < names.index("update_actor")
    (given,) = run.updated(0)
    rewards, values, mask, advantages, returns = rows_of(
        given.data, "rm_scores", "values", "response_mask", "advantages", "returns"
    )
    want_adv, want_ret = compute_gae_advantage_return(
        rewards, values, mask, config.algorithm.gamma, config.algorithm.lam
    )
    prompt_lens = given.data["prompts"].offsets().diff().tolist()
    response_lens = given.data["responses"].offsets().diff().tolist()
    for i, (p, n) in enumerate(zip(prompt_lens, response_lens)):
        # the critic's values are those of its forward (0.1 x position over the whole sequence)
        torch.testing.assert_close(values[i, :n], 0.1 * torch.arange(p, p + n, dtype=torch.float32))
        torch.testing.assert_close(advantages[i, :n], want_adv[i, :n])
        torch.testing.assert_close(returns[i, :n], want_ret[i, :n])
    assert advantages[mask.bool()].abs().sum() > 0 and not torch.equal(advantages, returns)
    (critic,) = run.workers.critic.trained
    assert critic.keys == given.keys
    torch.testing.assert_close(rows_of(critic.data, "returns")[0], returns)
    metrics = run.metrics(1)
    assert np.isfinite(metrics["critic/vf_loss"]) and metrics["critic/vf_loss"] > 0


def test_reference_log_probs_and_the_critics_values_reach_the_updates(ray_session, tmp_path, tiny_model_dir):
    """With the KL loss and a critic under an outcome estimator (verl's ``_compute_advantage`` does not
    run), the actor's update gets the reference policy's log-probs and the critic's update its values."""
    from verl.workers.utils.padding import response_from_nested

    from tests.helpers.verl_local_workers import sequence_outputs

    config = make_config(
        tmp_path,
        tiny_model_dir,
        "actor_rollout_ref.actor.use_kl_loss=true",
        "critic.enable=true",
        "critic.ppo_micro_batch_size_per_gpu=2",
        f"critic.model.path={tiny_model_dir}",
        *ONE_STEP,
    )
    run = Run(config)
    names = run.workers.names()
    order = ["compute_log_prob", "compute_ref_log_prob", "infer_batch", "train_mini_batch", "update_actor"]
    assert [names.index(name) for name in order] == sorted(names.index(name) for name in order)
    (given,) = run.updated(0)
    reference = sequence_outputs(run.workers.actor.ref_model, given.data, entropy=False)["log_probs"]
    want = response_from_nested(reference, given.data["response_mask"]).to_padded_tensor(0)
    torch.testing.assert_close(rows_of(given.data, "ref_log_prob")[0], want)
    (critic,) = run.workers.critic.trained
    (values,) = rows_of(critic.data, "values")
    for i, (p, n) in enumerate(zip(critic.data["prompts"].offsets().diff(), critic.data["responses"].offsets().diff())):
        torch.testing.assert_close(values[i, :n], 0.1 * torch.arange(p, p + n, dtype=torch.float32))
    metrics = run.metrics(1)
    assert np.isfinite(metrics["actor/kl_loss"]) and np.isfinite(metrics["critic/vf_loss"])


def test_gae_without_the_critic_is_rejected(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="critic.enable"):
        make_config(
            tmp_path,
            tiny_model_dir,
            "algorithm.adv_estimator=gae",
            "algorithm.enable_rollout_level_advantage=false",
            "critic.enable=false",
        )


def test_on_two_ranks_verls_dispatch_gets_the_torch_backends_mini_batches(ray_session, tmp_path, tiny_model_dir):
    """verl hands each rank a contiguous share of the batch and each rank cuts its share into
    mini-batches; the trainer orders the rows so that, across both ranks, optimizer step ``i`` trains
    the shaped batch's ``i``-th slice of rows."""
    config = make_config(tmp_path, tiny_model_dir, *ONE_STEP)
    run = Run(config, dp_size=2)
    shaped = run.prepared[0].shaped
    assert shaped.n_mini_batches == 2
    per_mini = len(shaped.rows) // 2
    ids = {tuple(int(t) for t in (*row.prompt_ids, *row.response_ids)): row.rollout_id for row in shaped.rows}
    steps = run.workers.actor.optimizer_steps
    assert len(steps) == 2 and all(len(minis) == 2 for minis in steps)  # two ranks per optimizer step
    for i, minis in enumerate(steps):
        trained = sorted(ids[tuple(row.tolist())] for mini in minis for row in mini["input_ids"].unbind())
        assert trained == sorted(row.rollout_id for row in shaped.rows[i * per_mini : (i + 1) * per_mini])
    assert "global_seqlen/balanced_max" in run.metrics(1)  # trainer.balance_batch: balanced within each mini-batch


class FailingSource(FakeSource):
    """A source whose training rollouts never come: its collect fails as a lost gateway would."""

    def collect(self, samples, *, step, is_train):
        raise ConnectionError("the gateway at http://127.0.0.1:1 stopped answering")


def test_a_failed_rollout_loop_ends_the_step_that_waits_for_its_groups(ray_session, tmp_path, tiny_model_dir):
    """verl's replay buffer polls until enough groups finish; when the thread that stores them has
    failed, the step raises that failure instead of waiting forever."""
    from agl_backend_verl.agent_loop import RolloutLoopError

    config = make_config(tmp_path, tiny_model_dir, "trainer.val_before_train=false", "trainer.test_freq=-1")
    plugins = PluginManager(load_entrypoints=False)
    with transfer_queue_session(config):
        trainer = local_trainer_class("sync", ENDPOINTS)(config, plugins=plugins)
        trainer.init()
        with pytest.raises(RolloutLoopError, match="ConnectionError: the gateway at .* stopped answering") as failed:
            fit_locally(trainer, FailingSource(plugins), N)
    assert isinstance(failed.value.__cause__, ConnectionError)
    assert "required_node_resource" in failed.value.hint
