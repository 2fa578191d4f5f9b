"""A tiny vision-language setup built offline: PNG data URLs, a Qwen2-VL image processor, a word-level
tokenizer with the placeholder tokens, and the recorded events of a 2-turn chat with an image per turn."""

from __future__ import annotations

import base64
import functools
import io
from typing import Any

from agl_core.stages.aggregation import ImagePlaceholders
from agl_core.stages.vision import VisionSpec
from agl_core.testing.word_policy import word_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
CORPUS = ["user assistant look at this what is it a cat and now that one dog red blue"]
MERGE = 2


def png_url(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> str:
    """A ``data:image/png;base64,...`` URL of a ``width`` × ``height`` image of one colour."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@functools.cache
def image_processor() -> Any:
    """Qwen2-VL's image processor, small: 28-pixel merged patches, at most 56 × 56 pixels an image
    (a 56 × 56 image is a (1, 4, 4) grid: 4 pad tokens; 28 × 56 is (1, 2, 4): 2)."""
    import transformers

    return transformers.Qwen2VLImageProcessor(
        min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=MERGE, temporal_patch_size=2
    )


@functools.cache
def tokenizer() -> Any:
    tok = word_tokenizer(CORPUS)
    tok.add_tokens(VISION_TOKENS, special_tokens=True)
    return tok


def spec() -> VisionSpec:
    return VisionSpec.from_processor(image_processor(), tokenizer())


def placeholders() -> ImagePlaceholders:
    found = ImagePlaceholders.of(tokenizer())
    assert found is not None
    return found


def ids(text: str) -> list[int]:
    return tokenizer().convert_tokens_to_ids(text.split())


def block(n_pads: int) -> list[int]:
    p = placeholders()
    return [p.vision_start, *[p.image_pad] * n_pads, p.vision_end]


# Two images of the chat: A (56 × 56, 4 pads) shown in turn 1, B (28 × 56, 2 pads) in turn 2.
URL_A = png_url(56, 56)
URL_B = png_url(56, 28, (10, 200, 40))
PADS = {URL_A: 4, URL_B: 2}


def chat_calls(first_image: str = URL_A, second_images: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """The two calls of the chat as (request messages, prompt ids, response ids): turn 2's prompt is
    turn 1's prompt + response + a user turn with the second image (``second_images``: the images
    turn 2's history holds, by default ``first_image`` then B)."""
    images_2 = (first_image, URL_B) if second_images is None else second_images
    prompt_1 = ids("user look at") + block(PADS[first_image]) + ids("what is it assistant")
    response_1 = ids("a red cat")
    prompt_2 = ids("user look at") + block(PADS[images_2[0]]) + ids("what is it assistant")
    prompt_2 += response_1 + ids("user and now")
    for url in images_2[1:]:
        prompt_2 += block(PADS[url])
    prompt_2 += ids("assistant")
    response_2 = ids("a blue dog")

    def part(url: str) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": url}}

    messages_1 = [{"role": "user", "content": [{"type": "text", "text": "look at"}, part(first_image)]}]
    messages_2 = [
        {"role": "user", "content": [{"type": "text", "text": "look at"}, part(images_2[0])]},
        {"role": "assistant", "content": "a red cat"},
        {"role": "user", "content": [{"type": "text", "text": "and now"}, *[part(u) for u in images_2[1:]]]},
    ]
    return [
        {"messages": messages_1, "prompt": prompt_1, "response": response_1},
        {"messages": messages_2, "prompt": prompt_2, "response": response_2},
    ]


def model_request(messages: Any, prompt: list[int], response: list[int]) -> dict[str, Any]:
    """A recorded successful chat call (the gateway's raw events format)."""
    return {
        "event_type": "model_request",
        "attempt_id": "a",
        "timestamp": 1.0,
        "data": {
            "request": {"model": "m", "messages": messages},
            "status": "ok",
            "http_status": 200,
            "response": {
                "prompt_token_ids": prompt,
                "choices": [{"token_ids": response, "logprobs": {"content": [{"logprob": -0.5} for _ in response]}}],
            },
        },
    }


def chat_events(calls: list[dict[str, Any]], reward: float = 1.0) -> list[dict[str, Any]]:
    events = [model_request(c["messages"], c["prompt"], c["response"]) for c in calls]
    return [*events, {"event_type": "reward", "attempt_id": "a", "timestamp": 2.0, "data": {"value": reward}}]
