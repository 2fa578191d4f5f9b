"""The reference backend's step pipeline on the corridor's tiny policy, checked exactly."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from agl_core import hookimpl
from agl_core.backends.ppo import response_log_probs
from agl_core.backends.torch.backend import TorchBackend
from agl_core.plugins import PluginManager
from agl_core.plugins.registry import RegistryError
from agl_core.runs.train import run
from tests.helpers.torch_runs import CONFIG, SAMPLES, Running, served_log_probs, tensors_of, torch_config

# The metrics every step of the reference backend reports.
STEP_METRICS = [
    "training/reward",
    "training/n_sample",
    "training/n_rollouts",
    "training/n_rollouts_w_trace",
    "training/n_rollouts_w_reward",
    "training/n_truncated_sample",
    "training/n_skipped_empty_rows",
    "training/n_turns",
    "training/n_sample_collected",
    "training/n_sample_trained",
    "training/n_sample_dropped/marked",
    "training/n_sample_dropped/same_reward",
    "training/n_sample_dropped/random",
    "training/n_groups",
    "training/n_zero_adv_groups",
    "training/n_unmerged_rollouts",
    "training/n_trace_merge_mismatch_rows",
    "training/rollout_level_advantage/n_rows",
    "training/rollout_level_advantage/n_rollouts",
    "training/rollout_level_advantage/n_multi_row_rollouts",
    "training/rollout_level_advantage/max_rows_per_rollout",
    "response_length/training/avg_by_turn",
    "response_length/training/max_by_turn",
    "response_length/training/min_by_turn",
    "timing/rollout_queue_wait_s/mean",
    "timing/rollout_run_duration_s/p90",
    "timing/rollout_total_s/max",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/pg_clipfrac_lower",
]


@pytest.fixture
def running(policy, tmp_path):
    started = []

    def start(*extra):
        started.append(Running(torch_config(policy, tmp_path, *extra)))
        return started[-1]

    yield start
    for r in started:
        r.close()


def test_a_step_changes_the_weights_and_the_engine_serves_them(running):
    r = running("agentlightning.local.agent_class=tests.helpers.agents:NoisyRewardAgent")
    backend = r.backend
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    text = backend.tokenizer.apply_chat_template(
        [{"role": "user", "content": "junction 1 : the sign points left"}], tokenize=False, add_generation_prompt=True
    )
    prompt = backend.tokenizer(text, add_special_tokens=False)["input_ids"]
    old_ids, old_served = served_log_probs(backend.engine, prompt, [0, 0])

    metrics = backend.train_step(SAMPLES)

    assert metrics["training/n_skipped_updates"] == 0.0 and metrics["actor/n_updates"] == 1.0
    changed = [k for k, v in backend.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "the optimizer step changed no weight"
    ids, served = served_log_probs(backend.engine, prompt, [0, 0])
    tensors = tensors_of(prompt, ids, backend.pad_token_id)
    with torch.no_grad():
        backend.model.eval()
        expected = response_log_probs(backend.model, tensors)[0, : len(ids)].tolist()
    assert served == pytest.approx(expected, abs=1e-5)
    assert (ids, served) != (old_ids, old_served)
    assert backend.engine.version == 1


def test_every_design_metric_is_reported_and_rows_merge_one_per_rollout(running):
    r = running()
    metrics = r.backend.train_step(SAMPLES)
    missing = [name for name in STEP_METRICS if name not in metrics]
    assert not missing
    assert metrics["training/n_rollouts"] == 8
    # n_groups counts the groups in the trained batch (as Agent Lightning v1.0 does): shaping may drop a
    # whole group whose rewards are all equal, and only then is it below the 2 groups collected.
    dropped = sum(metrics[f"training/n_sample_dropped/{why}"] for why in ("marked", "same_reward", "random"))
    assert metrics["training/n_groups"] == 2 or (metrics["training/n_groups"] == 1 and dropped >= 4)
    assert metrics["training/n_turns"] == 24  # 8 rollouts x 3 junctions
    # the word-level tokenizer re-renders replies exactly, unless a reply holds a special token
    assert metrics["training/n_sample"] == 8 + metrics["training/n_trace_merge_mismatch_rows"]


def test_marked_rows_are_dropped_whole_and_counted(running):
    r = running("agentlightning.trace_aggregator.trajectory_max_prompt_length=8")  # every prompt is longer
    metrics = r.backend.train_step(SAMPLES)
    assert metrics["training/n_sample_dropped/marked"] == metrics["training/n_sample"] > 0
    assert metrics["training/n_sample_trained"] == 0
    assert metrics["training/n_skipped_updates"] == 1.0 and "actor/pg_loss" not in metrics


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("algorithm.adv_estimator=nope", ["grpo", "rloo", "reinforce", "reinforce_baseline", "turn_grpo"]),
        (
            "actor_rollout_ref.actor.policy_loss.loss_mode=nope",
            ["cispo_per_rollout_mean", "per_rollout_mean", "token_mean"],
        ),
    ],
)
def test_unknown_names_fail_listing_what_is_registered(policy, tmp_path, override, names):
    config = torch_config(policy, tmp_path, override)
    with pytest.raises(RegistryError) as info:
        TorchBackend(config, PluginManager.from_config(config, load_entrypoints=False))
    message = str(info.value)
    assert "'nope'" in message and all(name in message for name in names)


class RowRewardAgent:
    """Reports its row's id / 10 as the reward, without calling the model: known validation rewards."""

    def run(self):
        import os

        headers = {"Authorization": f"Bearer {os.environ['AGL_KEY']}"}
        data = {"value": int(os.environ["ROW_ID"]) / 10}
        httpx.post(
            os.environ["AGL_EVENT_URL"], headers=headers, json={"event_type": "reward", "data": data}
        ).raise_for_status()


class SeenTemperatures:
    """Records the sampling temperature of every model call, by whether the rollout trains."""

    def __init__(self):
        self.by_mode: dict[bool, set[float]] = {True: set(), False: set()}

    @hookimpl
    def agl_on_succeeded(self, rollout, events, writer):
        for event in events["0"]:
            if event["event_type"] == "model_request":
                self.by_mode[rollout.is_train].add(event["data"]["request"]["temperature"])


def _val_file(tmp_path, n):
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps({"id": i, "signs": ["left", "right", "left"]}) + "\n" for i in range(n)))
    return path


def test_val_reward_is_the_mean_over_every_validation_batch(running, tmp_path):
    r = running(
        f"data.val_files={_val_file(tmp_path, 5)}",
        "data.val_batch_size=2",
        "agentlightning.local.agent_class=tests.backends.torch.test_backend:RowRewardAgent",
        "agentlightning.local.env_map.ROW_ID=input.id",
    )
    metrics = r.backend.validate()
    assert metrics["val/n_batches"] == 3 and metrics["val/n_rollouts"] == 5  # 2 + 2 + 1, one rollout per row
    assert metrics["val/reward"] == pytest.approx((0 + 1 + 2 + 3 + 4) / 10 / 5)  # the last batch alone: 0.4
    assert metrics["val/rollouts/n_succeeded"] == 5 and metrics["val/n_rollouts_w_reward"] == 5


def test_validation_samples_at_the_val_temperature_and_training_at_the_rollout_one(policy, tmp_path):
    seen = SeenTemperatures()
    overrides = _overrides_for_fit(policy, tmp_path, f"data.val_files={_val_file(tmp_path, 3)}", "trainer.test_freq=2")
    run(CONFIG, overrides, plugins=[seen], show_progress=False)
    assert seen.by_mode == {True: {1.0}, False: {0.0}}
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], "val/reward" in line) for line in lines] == [(0, True), (1, False), (2, True), (3, True)]
    assert all(line["val/n_rollouts"] == 3 for line in lines if "val/reward" in line)
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 1000


def _overrides_for_fit(policy, tmp_path, *extra):
    return [
        f"actor_rollout_ref.model.path={policy}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.total_training_steps=3",
        "trainer.save_freq=-1",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        *extra,
    ]


class ZeroPolicyLoss:
    """A policy loss that is always 0, so the entropy bonus is all an update follows."""

    @hookimpl
    def agl_register_policy_losses(self, register):
        register("zero", lambda old_log_prob, log_prob, *args, **kwargs: ((log_prob * 0.0).sum(), {}))


def _next_token_entropy(backend, content):
    text = backend.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([backend.tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        log_probs = torch.log_softmax(backend.model(ids).logits[0, -1].float(), -1)
        return float(-(log_probs.exp() * log_probs).sum())


@pytest.mark.parametrize("loss_normalization", ["rollouts", "upstream"])
def test_the_entropy_bonus_raises_the_entropy_and_nothing_moves_without_it(policy, tmp_path, loss_normalization):
    entropies = {}
    for coeff in (0.0, 1.0):
        config = torch_config(
            policy,
            tmp_path / str(coeff),
            "agentlightning.local.agent_class=tests.helpers.agents:NoisyRewardAgent",
            "actor_rollout_ref.actor.policy_loss.loss_mode=zero",
            f"agentlightning.loss_normalization={loss_normalization}",
            f"actor_rollout_ref.actor.entropy_coeff={coeff}",
            "actor_rollout_ref.actor.optim.lr=1e-4",
        )
        r = Running(config, [ZeroPolicyLoss()])
        backend = r.backend
        try:
            before = {k: v.clone() for k, v in backend.model.state_dict().items()}
            entropy_before = _next_token_entropy(backend, "junction 1 : the sign points left")
            metrics = backend.train_step(SAMPLES)
            moved = any(not torch.equal(v, before[k]) for k, v in backend.model.state_dict().items())
            entropies[coeff] = (
                entropy_before,
                _next_token_entropy(backend, "junction 1 : the sign points left"),
                moved,
            )
        finally:
            r.close()
        assert metrics["actor/n_updates"] == 1.0
        assert (
            0.0 < metrics["actor/entropy_loss"] <= float(torch.log(torch.tensor(float(len(backend.tokenizer))))) + 1e-4
        )
        # actor/pg_loss is the policy-loss term alone; actor/loss the total the optimizer minimised
        assert metrics["actor/pg_loss"] == 0.0 and metrics["actor/loss"] == pytest.approx(
            -coeff * metrics["actor/entropy_loss"]
        )
    assert entropies[0.0][2] is False  # a zero loss and no bonus: AdamW leaves every weight as it was
    before, after, moved = entropies[1.0]
    assert moved and after > before + 1e-4, (before, after)


def test_entropy_coeff_is_validated_by_name(policy, tmp_path):
    from agl_core.config import ConfigError

    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.entropy_coeff"):
        torch_config(policy, tmp_path, "actor_rollout_ref.actor.entropy_coeff=-0.1")


def test_the_lr_schedule_steps_only_with_the_optimizer(running, recwarn):
    started = running("agentlightning.local.agent_class=tests.helpers.agents:FailingAgent")
    backend = started.backend
    metrics = backend.train_step(backend.next_batch())  # every rollout fails: nothing to update on
    assert "actor/n_updates" not in metrics and backend.scheduler.last_epoch == 0
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
