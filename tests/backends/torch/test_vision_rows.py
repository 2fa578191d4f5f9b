"""Vision-language rows on the torch backend: the forward with images and mrope positions, its
micro-batches, prefix sharing's fallback, and two training steps on the recorded multimodal events."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agl_core.backends.torch.micro_batching import split
from agl_core.backends.torch.model_ops import MULTI_MODAL_INPUTS, model_inputs, response_log_probs
from tests.helpers.vl_batches import call_rows, vision_tensors


@pytest.fixture(scope="module")
def model(vision_policy_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vision_policy_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def batch(model):
    rows, inputs = call_rows()
    return rows, vision_tensors(model, rows, inputs)


def test_log_probs_with_images_are_the_recorded_ones(model, batch):
    """The recorded log-probs are the policy's under Qwen2-VL's own positions: the backend's forward
    (positions as ``[4, rows, L]``, images concatenated in row order) must find them again."""
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


def test_micro_batches_cut_positions_and_images_by_row_and_give_the_one_pass_log_probs(model, batch):
    rows, tensors = batch
    # Rows in another order than the batch's: the images must follow their rows.
    shuffled = [rows[i] for i in (5, 0, 3, 6, 1, 7, 2, 4)]
    inputs = list(tensors[MULTI_MODAL_INPUTS])
    tensors = vision_tensors(model, shuffled, [inputs[i] for i in (5, 0, 3, 6, 1, 7, 2, 4)])
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
