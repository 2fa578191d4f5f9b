"""Training rows → agl's padded batch → verl's DataProto → rows, with real verl."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.verl

pytest.importorskip("verl")

from verl import DataProto  # noqa: E402

from agl_backend_verl.dataproto import to_dataproto, to_padded_batch  # noqa: E402
from agl_core.data import TrainingRow  # noqa: E402
from agl_core.stages.tensorize import tensorize  # noqa: E402


def rows_from_dataproto(data: DataProto) -> list[TrainingRow]:
    """The training rows a ``DataProto`` of :func:`to_dataproto` holds (padding removed).

    The reward is the row's summed ``token_level_scores`` (float32, as it is trained on); log-probs
    come back only when the batch has ``rollout_log_probs``. Per-call details that are not tensors
    (``response_turns``, ``turn_rewards``) are not carried by a ``DataProto``.
    """
    batch = to_padded_batch(data)
    tensors = batch.tensors
    prompt_width = tensors["prompts"].shape[1]
    attention = tensors["attention_mask"].bool().cpu().numpy()
    prompts = tensors["prompts"].cpu().numpy()
    responses = tensors["responses"].cpu().numpy()
    response_mask = tensors["response_mask"].cpu().numpy()
    rewards = tensors["token_level_scores"].float().sum(dim=-1).cpu().numpy()
    log_probs = tensors.get("rollout_log_probs")
    log_probs = None if log_probs is None else log_probs.float().cpu().numpy()
    rows = []
    for i in range(len(batch)):
        in_prompt = attention[i, :prompt_width]
        in_response = attention[i, prompt_width:]
        rows.append(
            TrainingRow(
                prompt_ids=prompts[i][in_prompt],
                response_ids=responses[i][in_response],
                response_mask=response_mask[i][in_response],
                log_probs=None if log_probs is None else log_probs[i][in_response],
                reward=float(rewards[i]),
                rollout_id=str(batch.non_tensors["rollout_ids"][i]),
                group_id=str(batch.non_tensors["group_ids"][i]),
                turn_index=int(batch.non_tensors["turn_indices"][i]),
            )
        )
    return rows


@st.composite
def training_rows(draw, with_log_probs: bool):
    n_prompt = draw(st.integers(1, 12))
    n_response = draw(st.integers(1, 12))
    mask = draw(st.lists(st.integers(0, 1), min_size=n_response, max_size=n_response))
    mask[draw(st.integers(0, n_response - 1))] = 1  # at least one trained token
    ids = st.integers(1, 500)
    return TrainingRow(
        prompt_ids=draw(st.lists(ids, min_size=n_prompt, max_size=n_prompt)),
        response_ids=draw(st.lists(ids, min_size=n_response, max_size=n_response)),
        response_mask=mask,
        log_probs=[-(k % 7) / 8 * m for k, m in enumerate(mask)] if with_log_probs else None,
        # float32-exact rewards: the batch keeps rewards in float32
        reward=draw(st.integers(-64, 64)) / 16,
        rollout_id=f"r{draw(st.integers(0, 3))}",
        group_id=f"g{draw(st.integers(0, 1))}",
        turn_index=draw(st.integers(0, 3)),
    )


@settings(max_examples=40, deadline=None)
@given(st.booleans().flatmap(lambda lp: st.lists(training_rows(lp), min_size=1, max_size=6)))
def test_rows_round_trip_through_dataproto(rows):
    data = to_dataproto(tensorize(rows, pad_token_id=0), meta_info={"global_steps": 3})
    assert isinstance(data, DataProto)
    assert len(data) == len(rows)
    assert data.meta_info == {"global_steps": 3}
    assert list(data.non_tensor_batch["uid"]) == [row.group_id for row in rows]
    assert rows_from_dataproto(data) == list(rows)


def test_selecting_rows_keeps_columns_aligned():
    rows = [
        TrainingRow(
            prompt_ids=[1] * (i + 1),
            response_ids=[2, 3],
            response_mask=[1, 0],
            reward=float(i),
            rollout_id=f"r{i}",
            group_id=f"g{i % 2}",
        )
        for i in range(4)
    ]
    data = to_dataproto(tensorize(rows))
    kept = data[[3, 1]]
    assert rows_from_dataproto(kept) == [rows[3], rows[1]]
    assert to_padded_batch(kept).tensors["token_level_scores"].dtype.is_floating_point


def test_scores_stay_float32():
    import torch

    row = TrainingRow(prompt_ids=[1], response_ids=[2], response_mask=[1], reward=0.1, rollout_id="r", group_id="g")
    data = to_dataproto(tensorize([row]))
    assert data.batch["token_level_scores"].dtype == torch.float32
    assert rows_from_dataproto(data)[0].reward == float(np.float32(0.1))


def test_a_foreign_dataproto_is_refused_with_the_missing_columns():
    import torch

    data = DataProto.from_dict(tensors={"responses": torch.zeros(1, 2)})
    with pytest.raises(KeyError, match="rollout_ids"):
        rows_from_dataproto(data)
