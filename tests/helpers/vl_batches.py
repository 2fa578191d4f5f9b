"""Rows of the multimodal fixture (tests/fixtures/vl_recording) and their padded tensors."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch

from agl_core.backends.torch.model_ops import MULTI_MODAL_INPUTS
from agl_core.data import TrainingRow
from agl_core.stages.tensorize import tensorize
from agl_core.testing.vision_policy import vision_image_processor
from tests.helpers.vl_recording import load_vl_events


def images_of(messages):
    from PIL import Image

    parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"]]
    urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
    return [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).convert("RGB") for u in urls]


def call_rows():
    """Every recorded call as a row (the transition level), with its images' inputs."""
    rows, inputs = [], []
    processor = vision_image_processor()
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
                )
            )
            inputs.append(dict(processor(images=images_of(event["data"]["request"]["messages"]), return_tensors="pt")))
    return rows, inputs


def vision_tensors(model, rows, inputs):
    """Stand-in for tensorize with a VisionSpec: ``[rows, 4, L]`` positions (text, then mrope from the
    model's own ``get_rope_index``) and the per-row image inputs."""
    tensors = dict(tensorize(rows).tensors)
    ids, mask = tensors["input_ids"], tensors["attention_mask"]
    image_pad = model.config.image_token_id
    grids = torch.cat([i["image_grid_thw"] for i in inputs])
    mrope, _ = model.model.get_rope_index(ids, (ids == image_pad).int(), grids, attention_mask=mask)
    tensors["position_ids"] = torch.cat([tensors["position_ids"][None], mrope]).transpose(0, 1).contiguous()
    tensors[MULTI_MODAL_INPUTS] = np.array(inputs, dtype=object)
    return tensors
