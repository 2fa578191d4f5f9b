"""The tiny Qwen2-VL policy (agl_core.testing.vision_policy) and the multimodal fixture made with it."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.vl_recording import (
    EVENTS_FILE,
    RECORDING_FILE,
    generate,
    load_vl_events,
    parsed_rollouts,
    recording_lines,
)


@pytest.fixture(scope="module")
def loaded(vision_policy_dir):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(vision_policy_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(vision_policy_dir)


def test_the_folder_loads_offline_as_a_qwen2_vl_model_with_its_vision_tokens(loaded, vision_policy_dir):
    model, tokenizer = loaded
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    config = model.config
    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    assert ids == [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
    assert config.text_config.vocab_size == len(tokenizer)
    processor = json.loads((vision_policy_dir / "preprocessor_config.json").read_text())
    assert processor["processor_class"] == "Qwen2VLProcessor"
    assert processor["merge_size"] == config.vision_config.spatial_merge_size == 2


def test_a_left_padded_batch_with_images_and_mrope_positions_gives_finite_logits_that_see_the_images(loaded):
    """Two rows of the fixture's prompts, left-padded, positions as ``[4, rows, L]`` (text, then mrope)."""
    model, tokenizer = loaded
    calls = [e["data"]["response"] for r in load_vl_events()["rollouts"][:2] for e in r["events"][:1]]
    prompts = [c["prompt_token_ids"] for c in calls]
    prompts[1] = prompts[1][4:]  # a shorter second row: padding on the left
    width = max(map(len, prompts))
    input_ids = torch.full((2, width), tokenizer.pad_token_id)
    mask = torch.zeros((2, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    image_pad = model.config.image_token_id
    n_images = int((input_ids == image_pad).sum())
    grid = torch.tensor([[1, 4, 4], [1, 4, 4]])  # 4 placeholders each
    assert n_images == 8
    torch.manual_seed(0)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
    mrope, _ = model.model.get_rope_index(input_ids, (input_ids == image_pad).int(), grid, attention_mask=mask)
    text = (mask.cumsum(-1) - 1).clamp(min=0)
    positions = torch.cat([text[None], mrope])
    assert positions.shape == (4, 2, width)
    assert not torch.equal(mrope[1], mrope[2])  # the image's height and width positions differ

    def logits(pixel_values):
        with torch.no_grad():
            out = model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                pixel_values=pixel_values,
                image_grid_thw=grid,
            )
        return out.logits

    seen = logits(pixels)
    assert seen.shape == (2, width, len(tokenizer)) and torch.isfinite(seen).all()
    last = mask.sum(-1) > 0
    assert (seen[last, -1] - logits(torch.zeros_like(pixels))[last, -1]).abs().max() > 1e-4


def test_the_committed_fixture_is_what_the_generator_writes(vision_policy_dir):
    committed, fresh = load_vl_events(), generate(vision_policy_dir)
    assert committed.keys() == fresh.keys()
    for old, new in zip(committed["rollouts"], fresh["rollouts"], strict=True):
        assert old["rollout"] == new["rollout"]
        for a, b in zip(old["events"], new["events"], strict=True):
            if a["event_type"] == "model_request":
                a_lp = [c.pop("logprob") for c in a["data"]["response"]["choices"][0]["logprobs"]["content"]]
                b_lp = [c.pop("logprob") for c in b["data"]["response"]["choices"][0]["logprobs"]["content"]]
                assert a_lp == pytest.approx(b_lp, abs=1e-4)
            assert a == b
    assert EVENTS_FILE.stat().st_size < 64_000


def test_the_committed_recording_is_the_events_rollouts_for_this_policy(vision_policy_dir):
    """``agl replay`` reads the recording: its rollouts are the events' (image URLs included), its
    header fits the policy the fixture builds (the tokenizer's fingerprint), and it is what the
    generator writes."""
    from agl_core.files.recording import read_recording

    recording = read_recording(RECORDING_FILE)
    rollouts = parsed_rollouts(load_vl_events())
    assert list(recording.rollouts(1)) == rollouts
    assert all(t.image_urls for r in rollouts for t in r.triplets)
    committed = [json.loads(line) for line in RECORDING_FILE.read_text().splitlines()]
    assert committed == recording_lines(load_vl_events(), vision_policy_dir)


def test_each_turn_expands_its_images_placeholders_and_extends_the_previous_context(loaded):
    model, _ = loaded
    image_pad, start = model.config.image_token_id, model.config.vision_start_token_id
    for rollout in load_vl_events()["rollouts"]:
        first, second = (e["data"]["response"] for e in rollout["events"][:2])
        context = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
        assert second["prompt_token_ids"][: len(context)] == context
        assert first["prompt_token_ids"].count(start) == 1 and second["prompt_token_ids"].count(start) == 2
        # 56×56 is 2 × 2 merged patches, 28×56 is 1 × 2.
        assert first["prompt_token_ids"].count(image_pad) == 4 and second["prompt_token_ids"].count(image_pad) == 6


def test_its_vision_spec_loads_without_torchvision(vision_policy_dir, loaded):
    """Qwen2-VL's AutoProcessor needs torchvision (its video processor); the spec falls back on the
    image processor's PIL backend, which gives the same patches."""
    from agl_core import VisionSpec

    model, _ = loaded
    spec = VisionSpec.from_pretrained(vision_policy_dir)
    assert type(spec.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert spec.image_token_id == model.config.image_token_id and spec.spatial_merge_size == 2
