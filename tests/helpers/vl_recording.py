"""The multimodal fixture tests/fixtures/vl_recording/: gateway events of a vision-language agent.

A group of rollouts of one task, two chat turns each, an image in each turn's user message (turn 2's
request holds turn 1's whole conversation, its image included), then a reward. The events have the
shape the gateway records (tests/fixtures/gateway_traces/): the request's ``messages`` with
``image_url`` parts (PNG ``data:`` URLs), the response's ``prompt_token_ids`` with each image's
placeholder expanded as vLLM expands it (``<|vision_start|>``, one ``<|image_pad|>`` per merged
patch, ``<|vision_end|>``), the response's token ids and their log-probs.

Nothing here was recorded from a server: the ids come from the tiny policy's tokenizer
(:func:`agl_core.testing.vision_policy.build_vision_policy`, seed 0), the replies are drawn from its
words, and the log-probs are the tiny policy's own (a forward pass with Qwen2-VL's mrope positions),
so a trainer that computes them again from the rows should find them.

``rollouts.jsonl`` beside it is the same rollouts, parsed from those events, as agl's rollout
recording (:mod:`agl_core.files.recording`) holds one step of a torch run on that policy, so ``agl replay``
(:func:`agl_core.runs.replay.replay_step`, with ``actor_rollout_ref.model.path`` pointing at the policy)
trains on it. Its header's paths are placeholders and its time 0, so the file does not change from one
generation to the next. Regenerate both with ``python -m tests.helpers.vl_recording``;
tests/testing_kit/test_vision_policy.py checks the committed files are what this writes.
"""

from __future__ import annotations

import base64
import io
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agl_core.testing.vision_policy import build_vision_policy, vision_image_processor
from tests.helpers.paths import VL_RECORDING

__all__ = [
    "EVENTS_FILE",
    "RECORDING_FILE",
    "SEED",
    "generate",
    "load_vl_events",
    "parsed_rollouts",
    "png_data_url",
    "recording_lines",
    "write",
]

EVENTS_FILE = VL_RECORDING / "events.json"
RECORDING_FILE = VL_RECORDING / "rollouts.jsonl"
POLICY_PLACEHOLDER = "<agl_core.testing.vision_policy.build_vision_policy(seed=0)>"
SEED = 0
GROUP = "vl-task-0"
N_ROLLOUTS = 4
REWARDS = (1.0, 0.0, 0.0, 1.0)
SYSTEM = "you see pictures"
QUESTIONS = ("what colour is it", "and this one")
REPLY_WORDS = ("red", "green", "blue", "yellow", "black", "white", "i", "think", "maybe", "it", "is")
# (height, width) of each turn's image: 2 × 2 merged patches (4 placeholder tokens), then 1 × 2 (2).
IMAGE_SIZES = ((56, 56), (28, 56))
COLOURS = np.array([[200, 30, 30], [30, 160, 40], [40, 60, 210], [230, 210, 40]], np.uint8)


def png_data_url(height: int, width: int, rng: random.Random) -> str:
    """A PNG of 14-pixel blocks of a few colours (small once compressed), as a ``data:`` URL."""
    from PIL import Image

    blocks = np.array([[rng.randrange(len(COLOURS)) for _ in range(width // 14)] for _ in range(height // 14)])
    pixels = COLOURS[blocks].repeat(14, axis=0).repeat(14, axis=1)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _decode_image(url: str) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


class _Policy:
    """The tiny policy's tokenizer, image processor and model, to render prompts and score replies."""

    def __init__(self, folder: Path):
        from transformers import AutoModelForImageTextToText, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.images = vision_image_processor()
        self.model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
        config = self.model.config
        self.image_pad, self.merge = config.image_token_id, config.vision_config.spatial_merge_size

    def prompt(self, messages: list[dict[str, Any]]) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The prompt ids vLLM would generate from (placeholders expanded) and the images' inputs."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        urls = [
            part["image_url"]["url"]
            for m in messages
            if isinstance(m["content"], list)
            for part in m["content"]
            if part["type"] == "image_url"
        ]
        inputs = self.images(images=[_decode_image(u) for u in urls], return_tensors="pt")
        counts = iter((inputs["image_grid_thw"].prod(-1) // self.merge**2).tolist())
        expanded: list[int] = []
        for token in ids:
            expanded += [token] * next(counts) if token == self.image_pad else [token]
        return expanded, dict(inputs)

    @torch.no_grad()
    def log_probs(self, prompt: list[int], response: list[int], images: dict[str, torch.Tensor]) -> list[float]:
        ids = torch.tensor([prompt + response])
        positions, _ = self.model.model.get_rope_index(
            ids, (ids == self.image_pad).int(), image_grid_thw=images["image_grid_thw"]
        )
        logits = self.model(input_ids=ids, position_ids=positions, **images).logits[0, len(prompt) - 1 : -1]
        chosen = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])
        return [float(v) for v in chosen[:, 0]]


def _event(rollout_id: str, kind: str, data: dict[str, Any], time: float) -> dict[str, Any]:
    return {"event_type": kind, "rollout_id": rollout_id, "attempt_id": "0", "timestamp": time, "data": data}


def _call(policy: _Policy, messages: list[dict[str, Any]], reply: list[str], call_id: str) -> dict[str, Any]:
    """A ``model_request`` event's data: the chat request and vLLM's answer to it."""
    prompt, images = policy.prompt(messages)
    response = policy.tokenizer.convert_tokens_to_ids([*reply, "<|im_end|>"])
    log_probs = policy.log_probs(prompt, response, images)
    tokens = policy.tokenizer.convert_ids_to_tokens(response)
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(response), "total_tokens": len(prompt + response)}
    body = {"model": "tiny-vl", "messages": messages, "max_tokens": 8, "logprobs": True, "return_token_ids": True}
    return {
        "model": "tiny-vl",
        "model_version": 0,
        "request": body,
        "response": {
            "id": f"chatcmpl-{call_id}",
            "object": "chat.completion",
            "model": "tiny-vl",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " ".join(reply)},
                    "logprobs": {"content": [{"token": t, "logprob": lp} for t, lp in zip(tokens, log_probs)]},
                    "finish_reason": "stop",
                    "token_ids": response,
                }
            ],
            "usage": usage,
            "prompt_token_ids": prompt,
        },
        "http_status": 200,
        "status": "ok",
        "usage": usage,
        "finish_reason": "stop",
    }


def generate(policy_dir: Path | None = None) -> dict[str, Any]:
    """The fixture's content, from the tiny policy in ``policy_dir`` (built with seed 0 if ``None``)."""
    with tempfile.TemporaryDirectory() as scratch:
        policy = _Policy(policy_dir or build_vision_policy(Path(scratch) / "policy", SEED))
    rng = random.Random(SEED)
    first_image = png_data_url(*IMAGE_SIZES[0], rng)  # the task's image: the whole group sees it
    rollouts = []
    for n in range(N_ROLLOUTS):
        rollout_id, time = f"{GROUP}-r{n}", 1_800_000_000.0 + 10 * n
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        events = []
        for turn, question in enumerate(QUESTIONS):
            image = first_image if turn == 0 else png_data_url(*IMAGE_SIZES[1], rng)
            messages.append(
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": question}],
                }
            )
            reply = rng.choices(REPLY_WORDS, k=rng.randint(1, 3))
            data = _call(policy, [dict(m) for m in messages], reply, f"{rollout_id}-{turn}")
            events.append(_event(rollout_id, "model_request", data, time + turn))
            messages.append({"role": "assistant", "content": " ".join(reply)})
        events.append(_event(rollout_id, "reward", {"value": REWARDS[n]}, time + len(QUESTIONS)))
        record = {
            "rollout_id": rollout_id,
            "input": {"task": GROUP},
            "is_train": True,
            "status": {"state": "succeeded", "last_attempt_id": "0", "created_at": time, "updated_at": time + 5},
        }
        rollouts.append({"rollout": record, "group_id": GROUP, "events": events})
    return {
        "generated_by": "python -m tests.helpers.vl_recording",
        "policy": {"builder": "agl_core.testing.vision_policy.build_vision_policy", "seed": SEED},
        "rollouts": rollouts,
    }


def parsed_rollouts(events: dict[str, Any], step: int = 1) -> list[Any]:
    """The fixture's rollouts, parsed from their gateway events as a rollout source parses them."""
    from agl_core.data import RolloutRequest
    from agl_core.rollouts.events import completed_rollout_from_record

    out, samples = [], {}
    for recorded in events["rollouts"]:
        record = recorded["rollout"]
        request = RolloutRequest(
            rollout_id=record["rollout_id"],
            group_id=recorded["group_id"],
            input=record["input"],
            step=step,
            # the index of the group's dataset sample in the step, as a rollout source numbers them
            sample_index=samples.setdefault(recorded["group_id"], len(samples)),
        )
        rollout, _ = completed_rollout_from_record(request, record, recorded["events"], reward_fillna_value=0.0)
        out.append(rollout)
    return out


def recording_lines(events: dict[str, Any], policy_dir: Path) -> list[dict[str, Any]]:
    """The recording's lines: its header (a torch run of the corridor example's config on the policy in
    ``policy_dir``, one group of ``N_ROLLOUTS`` a step) and step 1, the events' rollouts."""
    from transformers import AutoTokenizer

    from agl_core.config import load_config
    from agl_core.files.recording import RecordingWriter

    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(
            "examples/corridor/config.yaml",
            [
                f"actor_rollout_ref.model.path={policy_dir}",
                f"trainer.default_local_dir={run_dir}",
                "data.train_batch_size=1",
                f"actor_rollout_ref.rollout.n={N_ROLLOUTS}",
                "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                "agentlightning.record_rollouts=true",
            ],
        )
        writer = RecordingWriter(config, AutoTokenizer.from_pretrained(policy_dir))
        writer.write(1, parsed_rollouts(events))
        header, *steps = (json.loads(line) for line in writer.path.read_text().splitlines())
    header["model"]["path"] = header["config"]["actor_rollout_ref"]["model"]["path"] = POLICY_PLACEHOLDER
    header["config"]["trainer"]["default_local_dir"] = "<run directory>"
    header["created_at"] = 0
    return [header, *steps]


def write(events_path: Path = EVENTS_FILE, recording_path: Path = RECORDING_FILE) -> tuple[Path, Path]:
    events = generate()
    events_path.parent.mkdir(parents=True, exist_ok=True)
    events_path.write_text(json.dumps(events, indent=1) + "\n")
    with tempfile.TemporaryDirectory() as scratch:
        lines = recording_lines(events, build_vision_policy(Path(scratch) / "policy", SEED))
    recording_path.write_text("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines))
    return events_path, recording_path


def load_vl_events(path: Path = EVENTS_FILE) -> dict[str, Any]:
    """The committed fixture."""
    return json.loads(path.read_text())


if __name__ == "__main__":
    print(write())
