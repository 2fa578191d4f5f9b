"""Vision-language rows on the torch backend: the forward with images and mrope positions, its
micro-batches, prefix sharing's fallback, and two training steps on the recorded multimodal events."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agl_core.backends.micro_batching import MULTI_MODAL_INPUTS, split
from agl_core.backends.ppo import model_inputs, response_log_probs
from tests.helpers.vl_batches import call_rows, vision_tensors


@pytest.fixture(scope="module")
def model(vision_policy_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vision_policy_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def batch(vision_policy_dir):
    rows = call_rows()
    return rows, vision_tensors(rows, vision_policy_dir)


def test_log_probs_with_images_are_the_recorded_ones(model, batch):
    """The recorded log-probs are the policy's under transformers' own mrope positions: the backend's
    forward of tensorize's rows (positions as ``[4, rows, L]``, images concatenated in row order) must
    find them again."""
    rows, tensors = batch
    assert tensors["position_ids"].shape[:2] == (len(rows), 4)
    with torch.no_grad():
        log_probs = response_log_probs(model, tensors)
    recorded = tensors["rollout_log_probs"]
    mask = tensors["response_mask"].bool()
    assert (log_probs[mask] - recorded[mask]).abs().max() < 1e-5  # text-only positions: ~1e-3 off


def test_the_images_change_the_log_probs(model, batch):
    _, tensors = batch
    blank = np.array([{**i, "pixel_values": torch.zeros_like(i["pixel_values"])} for i in tensors[MULTI_MODAL_INPUTS]])
    with torch.no_grad():
        seen = response_log_probs(model, tensors)
        unseen = response_log_probs(model, {**tensors, MULTI_MODAL_INPUTS: blank})
    mask = tensors["response_mask"].bool()
    assert (seen[mask] - unseen[mask]).abs().max() > 1e-4


def test_micro_batches_cut_positions_and_images_by_row_and_give_the_one_pass_log_probs(model, batch, vision_policy_dir):
    rows, _ = batch
    # Rows in another order than the recording's: the images must follow their rows.
    tensors = vision_tensors([rows[i] for i in (5, 0, 3, 6, 1, 7, 2, 4)], vision_policy_dir)
    with torch.no_grad():
        whole = response_log_probs(model, tensors)
        micros = split(tensors, max_tokens=120, key="k")
        assert len(micros) > 2
        for micro in micros:
            part = micro.cut(tensors)
            assert part["position_ids"].shape == (len(micro.rows), 4, part["input_ids"].shape[1])
            assert [id(x) for x in part[MULTI_MODAL_INPUTS]] == [id(tensors[MULTI_MODAL_INPUTS][r]) for r in micro.rows]
            n_pad = int((part["input_ids"] == model.config.image_token_id).sum())
            assert n_pad * 4 == model_inputs(part)["pixel_values"].shape[0]
            got = response_log_probs(model, part)
            width = micro.response_length
            assert torch.allclose(got, whole[micro.rows, :width], atol=1e-5)


# -- two training steps on the recorded multimodal events ------------------------------------------


def recorded_rollouts(step):
    """The fixture's rollouts, parsed from their gateway events as a rollout source parses them."""
    from tests.helpers.vl_recording import load_vl_events, parsed_rollouts

    return parsed_rollouts(load_vl_events(), step)


def vision_parameters(model):
    return {n: p for n, p in model.named_parameters() if n.startswith("model.visual.")}


@pytest.fixture(scope="module", params=["transition", "trajectory"])
def trained(request, vision_policy_dir, tmp_path_factory):
    """The torch backend on the tiny Qwen2-VL, two steps (``learn``: the step pipeline, then the actor
    update) on the recorded rollouts at one aggregation level; its metrics, and what it saw."""
    from agl_core.backends.torch.backend import TorchBackend
    from agl_core.plugins import PluginManager
    from tests.helpers.torch_runs import torch_config

    config = torch_config(
        vision_policy_dir,
        tmp_path_factory.mktemp("run"),
        f"agentlightning.trace_aggregator.level={request.param}",
        "data.train_batch_size=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
    )
    backend = TorchBackend(config, PluginManager.from_config(config, (), load_entrypoints=False))
    before = {n: p.detach().clone() for n, p in vision_parameters(backend.model).items()}
    prepared = backend.pipeline.prepare(recorded_rollouts(1), 1)
    batch = backend.actor_update.batch(prepared)  # the tensors and old log-probs step 1 trains on
    images = batch.tensors[MULTI_MODAL_INPUTS]
    blank = np.array([{k: torch.zeros_like(v) if k == "pixel_values" else v for k, v in i.items()} for i in images])
    with torch.no_grad():
        unseen = response_log_probs(backend.model, {**batch.tensors, MULTI_MODAL_INPUTS: blank})
    steps = [backend.learn(recorded_rollouts(step), step) for step in (1, 2)]
    grads = {n: p.grad for n, p in vision_parameters(backend.model).items()}
    after = {n: p.detach().clone() for n, p in vision_parameters(backend.model).items()}
    checkpoint = tmp_path_factory.mktemp("checkpoint")
    backend.save_checkpoint(checkpoint)
    return {
        "level": request.param,
        "prepared": prepared,
        "batch": batch,
        "unseen": unseen,
        "steps": steps,
        "before": before,
        "after": after,
        "grads": grads,
        "checkpoint": checkpoint,
    }


def test_two_steps_train_on_rows_with_images(trained):
    n_rows = {"transition": 8, "trajectory": 4}[trained["level"]]
    assert len(trained["prepared"].shaped.rows) == n_rows
    # A transition row of turn 2 holds turn 1's image too; a trajectory row holds both.
    images = sorted(len(row.image_urls) for row in trained["prepared"].shaped.rows)
    assert images == ([1] * 4 + [2] * 4 if trained["level"] == "transition" else [2] * 4)
    for metrics in trained["steps"]:
        for name in ("actor/pg_loss", "actor/grad_norm", "actor/entropy_loss", "actor/loss"):
            assert np.isfinite(metrics[name]), name
        assert metrics["actor/grad_norm"] > 0
        assert metrics["actor/n_updates"] >= 1
        assert metrics["perf/n_rows_unshared_images"] == n_rows  # image rows are not prefix-packed
    # step 2 sees the policy step 1 trained
    assert trained["steps"][0]["actor/entropy_loss"] != trained["steps"][1]["actor/entropy_loss"]


def test_the_vision_tower_gets_gradients_and_changes(trained):
    grads = trained["grads"]
    assert grads and all(g is not None for g in grads.values())
    assert max(float(g.abs().max()) for g in grads.values()) > 0
    moved = [n for n in trained["before"] if not torch.equal(trained["before"][n], trained["after"][n])]
    assert len(moved) == len(trained["before"])


def test_a_checkpoint_of_the_policy_loads_as_a_vision_language_model(trained):
    from agl_core.backends.torch.checkpoint import MODEL_DIR
    from agl_core.serving.models import is_vision_policy

    assert is_vision_policy(trained["checkpoint"] / MODEL_DIR)


def test_the_batch_carries_the_images_and_they_change_the_old_log_probs(trained):
    batch, unseen = trained["batch"], trained["unseen"]
    assert batch.tensors["position_ids"].shape[:2] == (len(batch.tensors[MULTI_MODAL_INPUTS]), 4)
    mask = batch.mask.bool()
    # The recorded rollout log-probs are the initial policy's: the backend's old log-probs find them.
    assert (batch.old_log_prob[mask] - batch.tensors["rollout_log_probs"][mask]).abs().max() < 1e-5
    assert (unseen[mask] - batch.old_log_prob[mask].to(unseen.device)).abs().max() > 1e-3


def test_agl_replay_trains_on_the_recorded_multimodal_step(vision_policy_dir, tmp_path):
    """The fixture's recording through ``agl replay``'s entry point: the recorded config, the policy
    given by path, the torch backend's replay_step."""
    import shutil

    from agl_core.runs.replay import replay_step
    from tests.helpers.vl_recording import RECORDING_FILE

    shutil.copy(RECORDING_FILE, tmp_path / "rollouts.jsonl")
    overrides = [f"actor_rollout_ref.model.path={vision_policy_dir}", "agentlightning.torch.num_threads=1"]
    metrics = replay_step(tmp_path, 1, overrides, scratch=tmp_path)
    assert np.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
    assert metrics["perf/n_rows_unshared_images"] == 4  # the recorded config's trajectory rows
