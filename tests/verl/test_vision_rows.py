"""Vision-language rows handed to verl's actor worker on CPU: verl 0.9.1's FSDP2 engine
(:mod:`tests.helpers.verl_vision`, one gloo rank) computes the old log-probs of the multimodal
fixture's rows, laid out as agl's V1 trainer writes them (``[4, length]`` mrope positions and
``multi_modal_inputs`` per row), and finds the log-probs the tiny Qwen2-VL policy recorded: only
with the images and their mrope positions does it (text positions move them by ~1e-3, blank images
by ~1e-1)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.slow]

pytest.importorskip("verl")

CPU_PADDING = "actor_rollout_ref.model.use_remove_padding=false"


@pytest.fixture(scope="module")
def batch_file(vision_policy_dir, tmp_path_factory):
    from tests.helpers.vl_batches import call_rows, vision_batch

    rows = call_rows()
    path = tmp_path_factory.mktemp("vl_batch") / "batch.pt"
    torch.save(vision_batch(rows, vision_policy_dir), path)
    return path, rows


def _run(vision_policy_dir, batch_file, out_dir, *overrides):
    from agl_core.serving.processes import free_port
    from tests.helpers.verl_vision import run_rank

    path, _ = batch_file
    args = (1, free_port(), str(vision_policy_dir), str(path), str(out_dir), overrides)
    torch.multiprocessing.spawn(run_rank, args=args, nprocs=1)
    return torch.load(out_dir / "result.pt", weights_only=False)


def test_verls_worker_computes_the_recorded_log_probs_of_rows_with_images(vision_policy_dir, batch_file, tmp_path):
    result = _run(vision_policy_dir, batch_file, tmp_path, CPU_PADDING)
    assert "error" not in result, result.get("traceback")
    _, rows = batch_file
    assert result["n_rows"] == len(rows) == 8
    for row, log_probs in zip(rows, result["log_probs"], strict=True):
        n = len(row.response_ids)
        assert log_probs.shape == (len(row.prompt_ids) + n,)  # verl's whole-sequence layout
        # position t holds the log-prob of token t + 1: the response's are the n before the last
        assert torch.allclose(log_probs[-n - 1 : -1], torch.tensor(row.log_probs), atol=1e-5)


def test_verls_padding_removal_for_qwen2_vl_needs_flash_attention(vision_policy_dir, batch_file, tmp_path):
    """verl's default (``use_remove_padding``) patches Qwen2-VL's attention with a flash-attention
    forward, which has nothing to call on CPU; agl's CPU mode turns it off (CPU_KEYS)."""
    result = _run(vision_policy_dir, batch_file, tmp_path, "actor_rollout_ref.model.use_remove_padding=true")
    assert result.get("error") == "NameError"
    assert "_flash_use_top_left_mask" in result["message"]


def test_training_rows_and_dataproto_carry_mrope_positions_and_images_in_row_order(batch_file):
    from agl_backend_verl.dataproto import to_dataproto, to_padded_batch
    from agl_backend_verl.transfer import training_rows

    path, rows = batch_file
    padded = torch.load(path, weights_only=False)
    order = [3, 0, 7, 5, 1, 2, 6, 4]
    zeros = torch.zeros(len(rows), padded.tensors["responses"].shape[1])
    written = training_rows(padded, order, zeros, zeros)
    images = list(written["multi_modal_inputs"])
    width = padded.tensors["prompts"].shape[1]
    for j, i in enumerate(order):
        n = len(rows[i].prompt_ids) + len(rows[i].response_ids)
        assert torch.equal(
            written["position_ids"][j], padded.tensors["position_ids"][i, :, width - len(rows[i].prompt_ids) :][:, :n]
        )
        assert images[j] is padded.non_tensors["multi_modal_inputs"][i]
    back = to_padded_batch(to_dataproto(padded))
    assert back.tensors["position_ids"].shape == (len(rows), 4, padded.tensors["input_ids"].shape[1])
    assert list(back.non_tensors["multi_modal_inputs"]) == list(padded.non_tensors["multi_modal_inputs"])


def test_the_trainer_reads_a_vision_spec_only_for_a_vision_language_policy(vision_policy_dir, tiny_model_dir):
    from transformers import AutoConfig

    from agl_backend_verl.trainer import vision_spec

    spec = vision_spec(str(vision_policy_dir))
    config = AutoConfig.from_pretrained(vision_policy_dir)
    assert (spec.image_token_id, spec.vision_start_token_id) == (config.image_token_id, config.vision_start_token_id)
    assert vision_spec(str(tiny_model_dir)) is None


@pytest.mark.ray
def test_rows_with_images_go_through_transfer_queue_unchanged(batch_file, vision_policy_dir, tmp_path):
    """The V1 trainer stores the step's rows in TransferQueue, where verl's workers fetch them: the
    mrope positions and each row's images come back as stored, row by row."""
    import transfer_queue as tq

    from agl_backend_verl.config import load_verl_config
    from agl_backend_verl.run import v1_config
    from agl_backend_verl.transfer import put_rows, training_rows
    from tests.helpers.verl_local_workers import transfer_queue_session

    path, rows = batch_file
    padded = torch.load(path, weights_only=False)
    order = [5, 2, 7, 0, 4, 1, 6, 3]
    zeros = torch.zeros(len(rows), padded.tensors["responses"].shape[1])
    written = training_rows(padded, order, zeros, zeros)
    config = load_verl_config(
        None,
        [
            f"actor_rollout_ref.model.path={vision_policy_dir}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.device=cpu",
            "agentlightning.agl_base_url=http://127.0.0.1:1",
        ],
    )
    with transfer_queue_session(v1_config(config)):
        stored = put_rows(written, [f"vl_{i}" for i in order])
        back = tq.kv_batch_get(
            keys=stored.keys, partition_id=stored.partition_id, select_fields=["position_ids", "multi_modal_inputs"]
        )
    sent = list(written["multi_modal_inputs"])
    got = list(back["multi_modal_inputs"])
    assert len(got) == len(order)
    for j, i in enumerate(order):
        assert torch.equal(back["position_ids"][j], written["position_ids"][j])
        assert sorted(got[j]) == sorted(sent[j]) == (["image_grid_thw", "pixel_values"] if rows[i].image_urls else [])
        for name, value in sent[j].items():
            assert torch.equal(torch.as_tensor(got[j][name]), torch.as_tensor(value)), (i, name)


def _equal_rows(n=2, length=5):
    return [torch.arange(4 * length).reshape(4, length) + 100 * i for i in range(n)]


def test_rows_of_one_length_survive_verls_mini_batch_selection():
    """A batch of [4, length] rows of one length is a nested tensor ragged along the 4 (as
    TransferQueue and torch's as_nested_tensor build it); verl's maybe_fix_3d_position_ids then marks
    the length ragged without moving the values, and the mini-batch selection fails. Patched
    (agl_backend_verl.mrope_positions, applied on import of verl), it selects the rows intact."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers import engine_workers

    rows = _equal_rows()

    def as_stored(layout):  # TransferQueue's layout: the rows' values stacked, offsets along the 4
        return torch.nested.nested_tensor_from_jagged(torch.cat(layout), offsets=torch.tensor([0, 4, 8]))

    broken = as_stored(rows)
    broken._ragged_idx = 2  # what verl's own function does to it
    with pytest.raises(RuntimeError):  # in the worker: "split_with_sizes expects split_sizes to sum exactly to ..."
        tu.index_select_tensor_dict(TensorDict({"position_ids": broken}, batch_size=2), torch.tensor([0]))

    uneven = [torch.zeros(4, 3, dtype=torch.int64), torch.ones(4, 7, dtype=torch.int64)]
    for layout, nested in (
        (rows, as_stored(rows)),
        (uneven, torch.nested.as_nested_tensor(uneven, layout=torch.jagged)),
    ):
        data = TensorDict({"position_ids": nested}, batch_size=2)
        engine_workers.maybe_fix_3d_position_ids(data)
        picked = tu.index_select_tensor_dict(data, torch.tensor([1, 0]))
        got = picked["position_ids"].unbind()
        assert [g.tolist() for g in got] == [layout[1].tolist(), layout[0].tolist()]


def test_the_patch_leaves_other_tensors_as_they_are():
    from agl_backend_verl.mrope_positions import ragged_along_length

    plain = torch.zeros(2, 4, 5)
    assert ragged_along_length(plain) is plain
    uneven = torch.nested.as_nested_tensor([torch.zeros(4, 3), torch.zeros(4, 6)], layout=torch.jagged)
    assert ragged_along_length(uneven) is uneven  # already ragged along the length
    flat = torch.nested.as_nested_tensor([torch.zeros(3), torch.zeros(6)], layout=torch.jagged)
    assert ragged_along_length(flat) is flat  # text rows: 2-D


@pytest.mark.ray
def test_verls_v1_trainer_trains_the_recorded_multimodal_step_as_the_torch_backend_does(vision_policy_dir, tmp_path):
    """The fixture's recorded step (one group of 4 two-turn rollouts with images) replayed through
    verl's V1 trainer in CPU mode (replica, rollout loop, TransferQueue, old/ref log-probs, the
    actor's update over two ranks) and through the torch backend, from the same initial policy:
    the same rows, and the same gradient."""
    import shutil

    from agl_backend_verl.cpu import CPU_KEYS
    from agl_core.runs.replay import replay_step
    from tests.helpers.vl_recording import RECORDING_FILE

    shutil.copy(RECORDING_FILE, tmp_path / "rollouts.jsonl")
    policy = f"actor_rollout_ref.model.path={vision_policy_dir}"
    micro_batches = [
        f"actor_rollout_ref.{key}_micro_batch_size_per_gpu=1"
        for key in ("actor.ppo", "rollout.log_prob", "ref.log_prob")
    ]
    (tmp_path / "verl").mkdir()
    (tmp_path / "torch").mkdir()
    on_verl = replay_step(
        tmp_path, 1, [policy, "agentlightning.backend=verl", *CPU_KEYS, *micro_batches], scratch=tmp_path / "verl"
    )
    on_torch = replay_step(tmp_path, 1, [policy, "agentlightning.torch.num_threads=1"], scratch=tmp_path / "torch")
    assert on_verl["training/n_sample"] == on_torch["training/n_sample"] == 4  # trajectory rows, all with images
    assert on_verl["actor/grad_norm"] == pytest.approx(on_torch["actor/grad_norm"], rel=1e-3)
    assert on_verl["actor/entropy_loss"] == pytest.approx(on_torch["actor/entropy_loss"], rel=1e-4)
