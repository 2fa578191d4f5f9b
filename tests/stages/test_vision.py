"""Vision-language rows → tensors: images loaded offline, the mrope index against transformers', the
vision inputs checked against the placeholder blocks, and the padded batch in verl's layout."""

from __future__ import annotations

import functools
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_core.backends.micro_batching import MicroBatch
from agl_core.data import DataValidationError, TrainingRow
from agl_core.errors import UsageError
from agl_core.stages.tensorize import tensorize
from agl_core.stages.vision import VisionSpec, load_image, mrope_position_ids, vision_inputs
from tests.helpers import vision_rows as v

VS, PAD, VE = 1001, 1002, 1003  # token ids of the random layouts (text ids are below 1000)


def transformers_rope_index(input_ids, attention_mask, grids, merge):
    """transformers' Qwen2VLModel.get_rope_index on one sequence, called without building a model."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    model = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=merge)),
        get_vision_position_ids=functools.partial(Qwen2VLModel.get_vision_position_ids, None),
    )
    ids = input_ids.unsqueeze(0)
    positions, _ = Qwen2VLModel.get_rope_index(
        model,
        ids,
        mm_token_type_ids=(ids == PAD).int(),
        image_grid_thw=grids if len(grids) else None,
        attention_mask=attention_mask.unsqueeze(0),
    )
    return positions[:, 0]


@st.composite
def layouts(draw):
    """A sequence of text runs and images (grids (1, h, w) with h, w multiples of the merge size),
    with left and right padding."""
    merge = draw(st.sampled_from([1, 2]))
    ids, grids = [], []
    for _ in range(draw(st.integers(0, 4))):
        ids += draw(st.lists(st.integers(0, 999), max_size=6))
        h, w = draw(st.integers(1, 4)) * merge, draw(st.integers(1, 4)) * merge
        grids.append([1, h, w])
        ids += [VS, *[PAD] * (h * w // merge**2), VE]
    ids += draw(st.lists(st.integers(0, 999), min_size=0 if grids else 1, max_size=6))
    left, right = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    input_ids = torch.tensor([0] * left + ids + [0] * right)
    mask = torch.tensor([0] * left + [1] * len(ids) + [0] * right)
    return input_ids, mask, torch.tensor(grids, dtype=torch.int64).reshape(-1, 3), merge


@settings(max_examples=150)
@given(layouts())
def test_the_mrope_index_is_transformers_qwen2_vl_index(layout):
    input_ids, mask, grids, merge = layout
    ours = mrope_position_ids(
        input_ids, mask, grids, image_token_id=PAD, vision_start_token_id=VS, spatial_merge_size=merge
    )
    assert ours.shape == (3, len(input_ids)) and ours.dtype == torch.int64
    assert torch.equal(ours, transformers_rope_index(input_ids, mask, grids, merge))


def test_the_mrope_index_of_one_image_by_hand():
    ids = torch.tensor([0, 5, VS, PAD, PAD, PAD, PAD, PAD, PAD, VE, 6])
    mask = torch.tensor([0] + [1] * 10)
    got = mrope_position_ids(
        ids, mask, torch.tensor([[1, 4, 6]]), image_token_id=PAD, vision_start_token_id=VS, spatial_merge_size=2
    )
    # text 0, 1; the 2 × 3 merged grid from base 2; the text goes on at 2 + 3 = 5
    assert got.tolist() == [
        [0, 0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
        [0, 0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
        [0, 0, 1, 2, 3, 4, 2, 3, 4, 5, 6],
    ]


def test_the_mrope_index_refuses_blocks_that_do_not_match_the_grids():
    ids = torch.tensor([VS, PAD, PAD, VE])
    mask = torch.ones(4, dtype=torch.int64)
    kwargs = {"image_token_id": PAD, "vision_start_token_id": VS, "spatial_merge_size": 2}
    with pytest.raises(ValueError, match="has 2 pad tokens"):
        mrope_position_ids(ids, mask, torch.tensor([[1, 4, 4]]), **kwargs)
    with pytest.raises(ValueError, match="1 image block"):
        mrope_position_ids(ids, mask, None, **kwargs)
    with pytest.raises(ValueError, match="do not follow a vision start"):
        mrope_position_ids(torch.tensor([7, PAD, VE]), mask[:3], torch.tensor([[1, 2, 2]]), **kwargs)


# -- images -----------------------------------------------------------------------------------------


def test_images_load_from_data_urls_files_and_paths(tmp_path):
    from PIL import Image

    assert load_image(v.URL_A).size == (56, 56) and load_image(v.URL_B).size == (56, 28)
    path = tmp_path / "a b.png"
    Image.new("L", (10, 20)).save(path)
    for url in (str(path), "file://" + str(path).replace(" ", "%20")):
        image = load_image(url)
        assert image.size == (10, 20) and image.mode == "RGB"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("https://example.com/cat.png", "no network"),
        ("data:image/png;base64,@@@", "cannot load"),
        ("data:image/png;base64,aGVsbG8=", "cannot identify"),
        ("/nowhere/cat.png", "No such file"),
    ],
)
def test_an_image_that_cannot_be_loaded_names_the_url_and_rollout(url, why):
    with pytest.raises(DataValidationError, match=why) as info:
        load_image(url, rollout_id="r-7", field="image_urls[1]")
    assert info.value.rollout_id == "r-7" and info.value.field == "image_urls[1]"
    assert url[:20] in str(info.value)


# -- rows -------------------------------------------------------------------------------------------


def vl_row(images, tokens, rollout_id="vl", response=None):
    response = v.ids("a red cat") if response is None else response
    return TrainingRow(
        prompt_ids=tokens,
        response_ids=response,
        response_mask=[1] * len(response),
        reward=1.0,
        rollout_id=rollout_id,
        group_id="g",
        image_urls=images,
    )


def two_image_row(rollout_id="vl"):
    tokens = v.ids("user look at") + v.block(4) + v.ids("and") + v.block(2) + v.ids("assistant")
    return vl_row((v.URL_A, v.URL_B), tokens, rollout_id)


def test_vision_inputs_are_the_processors_and_text_rows_have_none():
    text = vl_row((), v.ids("user what is it assistant"), "text")
    inputs = vision_inputs([two_image_row(), text], v.spec())
    expected = v.image_processor()(images=[load_image(v.URL_A), load_image(v.URL_B)], return_tensors="pt")
    assert inputs[1] == {}
    assert inputs[0]["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4]]
    assert torch.equal(inputs[0]["pixel_values"], expected["pixel_values"])


@pytest.mark.parametrize(
    ("images", "blocks", "field", "why"),
    [
        ((v.URL_A,), [4, 2], "image_urls", "1 image.* and 2 image placeholder block"),
        ((v.URL_A, v.URL_B), [4], "image_urls", "2 image.* and 1 image placeholder block"),
        ((v.URL_A, v.URL_B), [4, 4], "image_urls[1]", "has 4 pad tokens.* needs 2"),
    ],
)
def test_placeholder_blocks_that_do_not_match_the_images_are_refused_by_name(images, blocks, field, why):
    tokens = v.ids("user look")
    for n in blocks:
        tokens += v.block(n)
    with pytest.raises(DataValidationError, match=why) as info:
        vision_inputs([vl_row(images, tokens, "bad")], v.spec())
    assert info.value.rollout_id == "bad" and info.value.field == field


def test_the_spec_comes_from_a_processor_or_a_model_config():
    spec = v.spec()
    assert (spec.image_token_id, spec.vision_start_token_id, spec.spatial_merge_size) == (
        v.placeholders().image_pad,
        v.placeholders().vision_start,
        2,
    )
    config = types.SimpleNamespace(
        image_token_id=7, vision_start_token_id=8, vision_config=types.SimpleNamespace(spatial_merge_size=4)
    )
    from_config = VisionSpec.from_processor(v.image_processor(), config=config)
    assert (from_config.image_token_id, from_config.vision_start_token_id, from_config.spatial_merge_size) == (7, 8, 4)
    with pytest.raises(UsageError, match="image_pad"):
        VisionSpec.from_processor(v.image_processor(), tokenizer=None)


# -- the padded batch -------------------------------------------------------------------------------


def test_a_vision_batch_has_verl_position_ids_and_per_row_vision_inputs():
    text = vl_row((), v.ids("user what is it assistant"), "text", response=v.ids("a cat and a dog"))
    rows = [two_image_row(), text]
    batch = tensorize(rows, pad_token_id=0, vision=v.spec())
    t, mask = batch.tensors, batch.tensors["attention_mask"]
    assert t["position_ids"].shape == (2, 4, t["input_ids"].shape[1])
    for i in range(2):
        keep = mask[i].bool()
        assert t["position_ids"][i, 0, keep].tolist() == list(range(int(keep.sum())))
        assert (t["position_ids"][i, 0, ~keep] == 1).all()  # verl's text row: 1 off the mask
    grid = batch.non_tensors["multi_modal_inputs"][0]["image_grid_thw"]
    assert torch.equal(
        t["position_ids"][0, 1:],
        mrope_position_ids(
            t["input_ids"][0], mask[0], grid, image_token_id=v.placeholders().image_pad,
            vision_start_token_id=v.placeholders().vision_start, spatial_merge_size=2,
        ),
    )  # fmt: skip
    # A text row's mrope positions are its text positions on all three rows.
    keep = mask[1].bool()
    assert (t["position_ids"][1, 1:, keep] == torch.arange(int(keep.sum()))).all()
    column = batch.non_tensors["multi_modal_inputs"]
    assert column.dtype == object and column.shape == (2,) and column[1] == {}
    assert grid.tolist() == [[1, 4, 4], [1, 2, 4]]
    # The other tensors are the text batch's.
    plain = tensorize([vl_row((), r.prompt_ids, r.rollout_id, r.response_ids) for r in rows], pad_token_id=0)
    for name, value in plain.tensors.items():
        if name != "position_ids":
            assert torch.equal(value, t[name]), name


def test_rows_with_images_need_a_vision_model():
    with pytest.raises(UsageError, match="'vl-9'.*no image processor"):
        tensorize([two_image_row("vl-9")])


def test_a_text_batch_is_unchanged_without_vision():
    batch = tensorize([vl_row((), v.ids("user what is it assistant"), "t")])
    assert batch.tensors["position_ids"].ndim == 2 and "multi_modal_inputs" not in batch.non_tensors


def test_a_micro_batch_cut_of_a_vision_batch_equals_tensorizing_its_rows():
    short = vl_row((v.URL_B,), v.ids("user") + v.block(2) + v.ids("assistant"), "short", response=v.ids("a"))
    rows = [two_image_row(), short]
    spec = v.spec()
    batch = tensorize(rows, vision=spec)
    micro = MicroBatch(torch.tensor([1]), len(short.prompt_ids), len(short.response_ids))
    cut = micro.cut(batch.tensors)
    alone = tensorize(
        [short], vision=spec, prompt_length=len(short.prompt_ids), response_length=len(short.response_ids)
    )
    assert cut["position_ids"].shape == (1, 4, len(short.prompt_ids) + len(short.response_ids))
    for name, value in alone.tensors.items():
        assert torch.equal(cut[name], value), name
    [inputs] = micro.cut_rows(batch.non_tensors["multi_modal_inputs"])
    assert torch.equal(inputs["pixel_values"], alone.non_tensors["multi_modal_inputs"][0]["pixel_values"])
    assert micro.cut_rows(batch.non_tensors["rollout_ids"]).tolist() == ["short"]
    assert np.array_equal(batch.non_tensors["turn_indices"][[1]], micro.cut_rows(batch.non_tensors["turn_indices"]))
