"""Rows of the multimodal fixture (tests/fixtures/vl_recording), every call a row, and their tensors
as the torch backend holds them (``tensorize`` with the model's ``VisionSpec``)."""

from __future__ import annotations

from pathlib import Path

from agl_core.backends.micro_batching import MULTI_MODAL_INPUTS
from agl_core.data import TrainingRow
from agl_core.stages.tensorize import PaddedBatch, tensorize
from agl_core.stages.vision import VisionSpec
from tests.helpers.vl_recording import load_vl_events


def image_urls(messages) -> list[str]:
    parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"]]
    return [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]


def call_rows() -> list[TrainingRow]:
    """Every recorded call as a row (the transition level), with its recorded log-probs."""
    rows = []
    for rollout in load_vl_events()["rollouts"]:
        for turn, event in enumerate(e for e in rollout["events"] if e["event_type"] == "model_request"):
            response, choice = event["data"]["response"], event["data"]["response"]["choices"][0]
            rows.append(
                TrainingRow(
                    prompt_ids=response["prompt_token_ids"],
                    response_ids=choice["token_ids"],
                    response_mask=[1] * len(choice["token_ids"]),
                    reward=1.0,
                    rollout_id=rollout["rollout"]["rollout_id"],
                    group_id=rollout["group_id"],
                    turn_index=turn,
                    log_probs=[c["logprob"] for c in choice["logprobs"]["content"]],
                    image_urls=image_urls(event["data"]["request"]["messages"]),
                )
            )
    return rows


def vision_batch(rows, policy_dir: Path) -> PaddedBatch:
    return tensorize(rows, vision=VisionSpec.from_pretrained(policy_dir))


def vision_tensors(rows, policy_dir: Path) -> dict:
    """The batch's tensors with its rows' image inputs beside them, as the torch backend's update
    holds them."""
    padded = vision_batch(rows, policy_dir)
    return {**padded.tensors, MULTI_MODAL_INPUTS: padded.non_tensors["multi_modal_inputs"]}
