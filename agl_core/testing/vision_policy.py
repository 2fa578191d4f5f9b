"""A tiny vision-language (Qwen2-VL) policy built locally, for tests: nothing is downloaded.

Qwen2-VL is the vision-language model verl and vLLM train and serve with mrope (3-D rotary positions
for image tokens), so it is the one agl's vision rows are shaped for. The tokenizer is the word-level
one of :mod:`agl_core.testing.word_policy` with Qwen2-VL's vision tokens added; its chat template
renders an ``image_url`` part as ``<|vision_start|><|image_pad|><|vision_end|>``, and a prompt
holds one ``<|image_pad|>`` per merged patch (vLLM expands it so before it generates).
The image processor is the PIL one (torchvision is not required) with small pixel bounds, so a
28×28 image is one token and a 56×56 one four.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agl_core.testing.word_policy import word_tokenizer

__all__ = [
    "VISION_CHAT_TEMPLATE",
    "VISION_TOKENS",
    "WORDS",
    "build_vision_policy",
    "vision_image_processor",
    "vision_tokenizer",
]

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
VISION_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The words of the tiny tokenizer, fixed so that a tokenizer rebuilt later has the same ids.
WORDS = (
    "system user assistant you see pictures look at the picture what colour is it and this one"
    " red green blue yellow black white i think maybe"
).split()
# The smallest image is one merged patch (2 × 14 pixels a side); the largest 2 × 2 merged patches.
MIN_PIXELS, MAX_PIXELS = 28 * 28, 56 * 56


def vision_tokenizer(corpus: Iterable[str]) -> Any:
    """The word-level tokenizer of ``corpus`` with the vision tokens, and the chat template above."""
    from tokenizers import AddedToken

    tokenizer = word_tokenizer(corpus)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS]}
    )
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    return tokenizer


def vision_image_processor() -> Any:
    """Qwen2-VL's image processor (its PIL backend) with the small pixel bounds above."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def build_vision_policy(out_dir: Path, seed: int, corpus: Iterable[str] = ()) -> Path:
    """Write a random ``Qwen2VLForConditionalGeneration`` (drawn after ``torch.manual_seed(seed)``), its
    tokenizer (of ``corpus`` and a few chat words) and image processor to ``out_dir``;
    ``AutoModelForImageTextToText``, ``AutoTokenizer`` and ``AutoImageProcessor`` load it offline
    (``AutoProcessor`` too where torchvision is installed). Sizes: text hidden 64, 2 layers, 4 heads; vision
    depth 1, width 32."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tokenizer = vision_tokenizer([" ".join(WORDS), *corpus])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            # head_dim 16: 8 rotary frequencies, split over the temporal, height and width positions.
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        # No video token in the vocabulary: an id past it, which no prompt holds.
        video_token_id=len(tokenizer),
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    vision_image_processor().save_pretrained(out_dir)
    # The processor's parts are saved one by one: building a Qwen2VLProcessor needs its video processor,
    # which needs torchvision. Naming the class lets AutoProcessor assemble it where torchvision is.
    config_file = out_dir / "preprocessor_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "processor_class": "Qwen2VLProcessor"}))
    return out_dir
