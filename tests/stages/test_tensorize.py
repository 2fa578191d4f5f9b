"""Padding rows into verl's batch layout: exact tensors for hand-built rows, and a round trip."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from agl_core.builtins.aggregators import trajectory
from agl_core.data import DataValidationError, TrainingRow
from agl_core.stages.tensorize import pad_responses, padded_width, tensorize
from agl_core.testing.strategies import aggregation_settings, rollout_batches


def row(prompt, response, mask, log_probs=None, reward=1.0, rollout_id="r", turn_index=0, dropped=False):
    return TrainingRow(
        prompt_ids=prompt,
        response_ids=response,
        response_mask=mask,
        log_probs=log_probs,
        reward=reward,
        rollout_id=rollout_id,
        group_id=f"g-{rollout_id}",
        turn_index=turn_index,
        dropped=dropped,
    )


def test_two_rows_in_verl_layout():
    a = row([1, 2, 3], [4, 5, 6], [1, 0, 1], log_probs=[-0.5, 0.0, -1.5], reward=0.25, rollout_id="a")
    b = row([7], [8], [1], log_probs=[-2.0], reward=-1.0, rollout_id="b", turn_index=3)
    batch = tensorize([a, b], pad_token_id=99)
    t = batch.tensors

    assert t["prompts"].tolist() == [[99] * 5 + [1, 2, 3], [99] * 7 + [7]]
    assert t["responses"].tolist() == [[4, 5, 6] + [99] * 5, [8] + [99] * 7]
    assert torch.equal(t["input_ids"], torch.cat([t["prompts"], t["responses"]], dim=1))
    assert t["attention_mask"].tolist() == [[0] * 5 + [1] * 6 + [0] * 5, [0] * 7 + [1] * 2 + [0] * 7]
    assert t["position_ids"].tolist() == [
        [0] * 5 + [0, 1, 2, 3, 4, 5] + [5] * 5,
        [0] * 7 + [0, 1] + [1] * 7,
    ]
    assert t["response_mask"].tolist() == [[1, 0, 1] + [0] * 5, [1] + [0] * 7]
    assert t["token_level_scores"].dtype == torch.float32
    assert t["token_level_scores"].tolist() == [[0, 0, 0.25] + [0] * 5, [-1.0] + [0] * 7]
    assert t["rollout_log_probs"].dtype == torch.float32
    assert t["rollout_log_probs"].tolist() == [[-0.5, 0.0, -1.5] + [0] * 5, [-2.0] + [0] * 7]
    assert batch.non_tensors["rollout_ids"].tolist() == ["a", "b"]
    assert batch.non_tensors["group_ids"].tolist() == ["g-a", "g-b"]
    assert batch.non_tensors["turn_indices"].tolist() == [0, 3]
    assert len(batch) == 2
    for name in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert t[name].dtype == torch.int64, name


def test_the_reward_sits_on_the_last_trained_token_after_truncation():
    # A row cut at the response limit ends on observation tokens; they are never trained.
    truncated = row([1], [2, 3, 4, 5], [1, 1, 0, 0], reward=0.5)
    scores = tensorize([truncated]).tensors["token_level_scores"]
    assert scores.tolist() == [[0.0, 0.5] + [0.0] * 6]


def test_a_reward_keeps_float32_precision():
    scores = tensorize([row([1], [2], [1], reward=0.1234567)]).tensors["token_level_scores"]
    assert scores[0, 0].item() == pytest.approx(np.float32(0.1234567), abs=0)


def test_rollout_log_probs_only_when_every_row_has_them():
    batch = tensorize([row([1], [2], [1], log_probs=[-1.0]), row([1], [2], [1])])
    assert "rollout_log_probs" not in batch.tensors


def test_widths_round_up_to_a_multiple_of_eight():
    batch = tensorize([row(list(range(9)), list(range(17)), [1] * 17)])
    assert batch.tensors["prompts"].shape == (1, 16) and batch.tensors["responses"].shape == (1, 24)
    assert [padded_width(n) for n in (0, 1, 8, 9)] == [8, 8, 8, 16]


def test_fixed_widths_for_backends_that_need_them():
    batch = tensorize([row([1, 2], [3], [1])], prompt_length=5, response_length=3)
    assert batch.tensors["input_ids"].tolist() == [[0, 0, 0, 1, 2, 3, 0, 0]]
    with pytest.raises(ValueError, match="response_length: a row has 3 tokens, more than the width 2"):
        tensorize([row([1], [2, 3, 4], [1, 1, 1])], response_length=2)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (row([1], [2], [1], dropped=True, rollout_id="x"), "rollout 'x': dropped"),
        (row([1], [2], [0], rollout_id="y"), "rollout 'y': response_mask"),
    ],
)
def test_rows_that_cannot_be_trained_are_refused(bad, message):
    with pytest.raises(DataValidationError, match=message):
        tensorize([bad])


def test_an_empty_batch_is_refused():
    with pytest.raises(ValueError, match="no rows"):
        tensorize([])


def test_pad_responses_right_pads_per_row_arrays():
    out = pad_responses([np.array([0.5, -1.0]), np.array([2.0])], 4, torch.float32)
    assert out.dtype == torch.float32 and out.tolist() == [[0.5, -1.0, 0, 0], [2.0, 0, 0, 0]]
    with pytest.raises(ValueError, match="more than the width 1"):
        pad_responses([[1.0, 2.0]], 1, torch.float32)


@given(batch=rollout_batches(), agg_settings=aggregation_settings())
@settings(deadline=None)
def test_every_row_is_recovered_from_the_padded_batch(batch, agg_settings):
    rows = [r for r in trajectory(batch, agg_settings).rows if not r.dropped]
    if not rows:
        return
    t = tensorize(rows).tensors
    width = t["prompts"].shape[1]
    assert width % 8 == 0 and t["responses"].shape[1] % 8 == 0
    for i, r in enumerate(rows):
        attention = t["attention_mask"][i].bool()
        assert t["input_ids"][i][attention].tolist() == r.prompt_ids.tolist() + r.response_ids.tolist()
        assert t["position_ids"][i][attention].tolist() == list(range(len(r.prompt_ids) + len(r.response_ids)))
        assert t["response_mask"][i, : len(r.response_ids)].tolist() == r.response_mask.tolist()
        assert t["response_mask"][i, len(r.response_ids) :].sum() == 0
        nonzero = t["token_level_scores"][i].nonzero().flatten().tolist()
        last_trained = int(np.flatnonzero(r.response_mask)[-1])
        assert nonzero in ([last_trained], []) and t["token_level_scores"][i, last_trained] == np.float32(r.reward)
