"""A row's images → the model's vision inputs and its mrope position ids (Qwen2-VL's layout).

A vision-language row (``TrainingRow.image_urls``) holds, for each image, a placeholder block in its
prompt + response ids: ``<|vision_start|>``, then ``N`` × ``<|image_pad|>``, then
``<|vision_end|>``, where ``N = t·h·w / merge²`` for the image's patch grid ``(t, h, w)``
(``image_grid_thw``) and the vision encoder's ``spatial_merge_size`` (the server expands the
blocks so; the prompt ids it returns hold them expanded).

- :func:`load_image` opens a ``data:image/...;base64,...`` URL, a ``file://`` URL or an absolute
  path (the trainer fetches nothing from the network).
- :func:`vision_inputs` runs the model's image processor on each row's images, giving
  ``pixel_values`` and ``image_grid_thw``, and checks that the row's placeholder blocks match them.
- :func:`mrope_position_ids` is the 3-D rope index (temporal, height, width) of one sequence: text
  tokens count up on all three rows; an image block's pad tokens take ``base + (t, h, w)`` over the
  merged grid, ``base`` the position the block starts at; the count then goes on from the block's
  largest position + 1. Positions outside the attention mask are 0, as ``transformers`` leaves them.
- :func:`batch_position_ids` is verl's layout for a padded batch, ``(B, 4, L)``: row 0 the text
  positions (0, 1, 2... over the attention mask, 1 elsewhere), rows 1-3 the mrope positions.

:class:`VisionSpec` is what :func:`agl_core.stages.tensorize.tensorize` needs of a vision-language
model (its ``vision`` argument).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from agl_core.data import DataValidationError, TrainingRow
from agl_core.errors import UsageError
from agl_core.fields import is_int
from agl_core.stages.aggregation import image_blocks

__all__ = [
    "VisionSpec",
    "batch_position_ids",
    "load_image",
    "mrope_position_ids",
    "placeholder_runs",
    "vision_inputs",
]

VISION_START = "<|vision_start|>"
IMAGE_PAD = "<|image_pad|>"


def _positive(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_int(value, minimum=1):
        raise UsageError(f"VisionSpec.{attribute.name} must be a positive int, got {value!r}")


def _token_id(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_int(value, minimum=0):
        raise UsageError(f"VisionSpec.{attribute.name} must be a token id (a non-negative int), got {value!r}")


@attrs.frozen(kw_only=True)
class VisionSpec:
    """What turning a vision-language model's rows into tensors needs: its ``image_processor`` (called
    as ``image_processor(images=[PIL images], return_tensors="pt")``, giving ``pixel_values`` and
    ``image_grid_thw``), the ids of ``<|image_pad|>`` and ``<|vision_start|>`` and the vision
    encoder's ``spatial_merge_size``."""

    image_processor: Any = attrs.field(eq=False, repr=False)
    image_token_id: int = attrs.field(validator=_token_id)
    vision_start_token_id: int = attrs.field(validator=_token_id)
    spatial_merge_size: int = attrs.field(validator=_positive)

    @classmethod
    def from_processor(cls, processor: Any, tokenizer: Any = None, config: Any = None) -> VisionSpec:
        """From a Hugging Face processor (``Qwen2VLProcessor``: its ``image_processor`` and
        ``tokenizer``) or a bare image processor with ``tokenizer``; ``config`` (the model's) gives the
        token ids and merge size where it has them, else the tokenizer and image processor do."""
        image_processor = getattr(processor, "image_processor", processor)
        tokenizer = tokenizer if tokenizer is not None else getattr(processor, "tokenizer", None)

        def token(config_key: str, text: str, processor_key: str | None = None) -> int:
            for value in (getattr(config, config_key, None), getattr(processor, processor_key or "", None)):
                if is_int(value, minimum=0):
                    return value
            convert = getattr(tokenizer, "convert_tokens_to_ids", None)
            value = convert(text) if convert is not None else None
            if not is_int(value, minimum=0) or value == getattr(tokenizer, "unk_token_id", None):
                raise UsageError(
                    f"VisionSpec: cannot find the id of {text}: neither the model config nor the tokenizer has it"
                )
            return value

        vision_config = getattr(config, "vision_config", None)
        merge = getattr(vision_config, "spatial_merge_size", None) or getattr(image_processor, "merge_size", None)
        if merge is None:
            raise UsageError("VisionSpec: neither the model config nor the image processor gives spatial_merge_size")
        return cls(
            image_processor=image_processor,
            image_token_id=token("image_token_id", IMAGE_PAD, "image_token_id"),
            vision_start_token_id=token("vision_start_token_id", VISION_START),
            spatial_merge_size=merge,
        )

    @classmethod
    def from_pretrained(cls, model_path: str | os.PathLike[str]) -> VisionSpec | None:
        """The spec of the model folder ``model_path`` (read locally), or ``None`` when the model has
        no image processor (a text-only model)."""
        from transformers import AutoConfig, AutoProcessor, AutoTokenizer

        config = AutoConfig.from_pretrained(model_path)
        try:
            processor = AutoProcessor.from_pretrained(model_path)
        except ImportError:  # Qwen2-VL's processor needs torchvision (its video processor); images do not
            image_processor = _pil_image_processor(model_path)
            if image_processor is None:
                raise
            return cls.from_processor(image_processor, AutoTokenizer.from_pretrained(model_path), config=config)
        except (OSError, ValueError, KeyError):
            return None
        if getattr(processor, "image_processor", None) is None:
            return None
        return cls.from_processor(processor, config=config)


def _pil_image_processor(model_path: str | os.PathLike[str]) -> Any:
    """The PIL backend of the image processor ``preprocessor_config.json`` names (transformers'
    ``<Name>Pil``, which needs no torchvision), loaded from ``model_path``; ``None`` if there is none."""
    import json

    import transformers

    path = os.path.join(os.fspath(model_path), "preprocessor_config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        name = json.load(f).get("image_processor_type")
    pil = getattr(transformers, f"{name}Pil", None) if isinstance(name, str) else None
    return None if pil is None else pil.from_pretrained(model_path)


# -- images -----------------------------------------------------------------------------------------


def load_image(url: str, *, rollout_id: str | None = None, field: str = "image_urls") -> Any:
    """The RGB ``PIL.Image`` of ``url``: a ``data:image/...;base64,...`` URL, a ``file://`` URL or an
    absolute path. One that cannot be read is a :class:`DataValidationError` naming ``field``, the
    URL's first characters and ``rollout_id``."""
    from PIL import Image, UnidentifiedImageError

    try:
        if url.startswith("data:"):
            head, _, payload = url.partition(",")
            if not head.startswith("data:image/") or not head.endswith(";base64"):
                raise UsageError("not a base64 image data URL (data:image/<type>;base64,...)")
            source: Any = io.BytesIO(base64.b64decode(payload, validate=True))
        elif url.startswith("file://"):
            source = urllib.parse.unquote(urllib.parse.urlparse(url).path)
        elif url.startswith("/"):
            source = url
        else:
            raise UsageError("only data:image/...;base64, file:// URLs and absolute paths are loaded (no network)")
        with Image.open(source) as image:
            return image.convert("RGB")
    except (OSError, ValueError, binascii.Error, UnidentifiedImageError) as exc:
        raise DataValidationError(field, f"cannot load the image {url[:40]!r}...: {exc}", rollout_id) from None


# -- placeholder blocks and positions ---------------------------------------------------------------


def placeholder_runs(ids: np.ndarray, image_token_id: int, vision_start_token_id: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` spans of the ``<|image_pad|>`` runs of ``ids`` (one per image); a run not
    right after ``<|vision_start|>`` is a ``ValueError``."""
    ids = np.asarray(ids)
    runs = [(start + 1, end - 1) for start, end in image_blocks(ids, image_token_id)]
    for start, _ in runs:
        if start == 0 or ids[start - 1] != vision_start_token_id:
            raise UsageError(f"the image pad tokens at position {start} do not follow a vision start token")
    return runs


def _grid_tokens(grid: Sequence[int], merge: int) -> int:
    t, h, w = (int(v) for v in grid)
    return t * h * w // (merge * merge)


def mrope_position_ids(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    *,
    image_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int,
) -> torch.Tensor:
    """The 3-D rope positions ``(3, L)`` (temporal, height, width; int64) of one sequence of ``L``
    ids whose image blocks hold the images of ``image_grid_thw`` (``(n_images, 3)``, in order; ``None``
    or empty for a text sequence). Positions are counted over the tokens the attention mask keeps;
    the others are 0. A block whose pad count is not its grid's ``t·h·w / merge²``, or a count of
    blocks other than of grids, is a ``ValueError``."""
    ids = torch.as_tensor(input_ids).cpu().numpy()
    keep = torch.as_tensor(attention_mask).cpu().numpy().astype(bool)
    grids = np.zeros((0, 3), np.int64) if image_grid_thw is None else torch.as_tensor(image_grid_thw).cpu().numpy()
    kept = ids[keep]
    runs = placeholder_runs(kept, image_token_id, vision_start_token_id)
    if len(runs) != len(grids):
        raise UsageError(f"the sequence has {len(runs)} image block(s) for {len(grids)} image grid(s)")
    merge = spatial_merge_size
    positions = np.empty((3, len(kept)), np.int64)
    current = done = 0
    for (start, end), grid in zip(runs, grids):
        positions[:, done:start] = current + np.arange(start - done)
        current += start - done
        if end - start != _grid_tokens(grid, merge):
            raise UsageError(
                f"the image block at position {start} has {end - start} pad tokens; its grid {grid.tolist()} "
                f"needs {_grid_tokens(grid, merge)}"
            )
        t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
        positions[0, start:end] = current + np.repeat(np.arange(t), h * w)
        positions[1, start:end] = current + np.tile(np.repeat(np.arange(h), w), t)
        positions[2, start:end] = current + np.tile(np.arange(w), t * h)
        current += max(t, h, w)  # the block's largest position + 1
        done = end
    positions[:, done:] = current + np.arange(len(kept) - done)
    out = np.zeros((3, len(ids)), np.int64)
    out[:, keep] = positions
    return torch.from_numpy(out)


def batch_position_ids(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    image_grid_thw: Sequence[torch.Tensor | None],
    spec: VisionSpec,
) -> torch.Tensor:
    """verl's position ids of a padded vision-language batch, ``(B, 4, L)`` int64: row 0 the text
    positions (0, 1, 2... over each row's attention mask, 1 elsewhere), rows 1-3 the row's
    :func:`mrope_position_ids` (``image_grid_thw[i]``: row ``i``'s grids, ``None`` for a text row)."""
    batch, length = input_ids.shape
    out = torch.ones((batch, 4, length), dtype=torch.int64)
    for i in range(batch):
        keep = attention_mask[i].bool()
        out[i, 0, keep] = torch.arange(int(keep.sum()), dtype=torch.int64)
        out[i, 1:] = mrope_position_ids(
            input_ids[i],
            attention_mask[i],
            image_grid_thw[i],
            image_token_id=spec.image_token_id,
            vision_start_token_id=spec.vision_start_token_id,
            spatial_merge_size=spec.spatial_merge_size,
        )
    return out


# -- rows -------------------------------------------------------------------------------------------


def _row_inputs(row: TrainingRow, spec: VisionSpec) -> dict[str, torch.Tensor]:
    images = [
        load_image(url, rollout_id=row.rollout_id, field=f"image_urls[{i}]") for i, url in enumerate(row.image_urls)
    ]
    processed = spec.image_processor(images=images, return_tensors="pt")
    pixel_values = torch.as_tensor(processed["pixel_values"])
    grid = torch.as_tensor(processed["image_grid_thw"], dtype=torch.int64).reshape(-1, 3)
    ids = np.concatenate([row.prompt_ids, row.response_ids])
    try:
        runs = placeholder_runs(ids, spec.image_token_id, spec.vision_start_token_id)
    except ValueError as exc:
        raise DataValidationError(
            "image_urls", f"the row's placeholder blocks are malformed: {exc}", row.rollout_id
        ) from None
    if len(runs) != len(row.image_urls):
        raise DataValidationError(
            "image_urls",
            f"the row has {len(row.image_urls)} image(s) and {len(runs)} image placeholder block(s) in its tokens",
            row.rollout_id,
        )
    for i, ((start, end), image_grid) in enumerate(zip(runs, grid.tolist())):
        needed = _grid_tokens(image_grid, spec.spatial_merge_size)
        if end - start != needed:
            raise DataValidationError(
                f"image_urls[{i}]",
                f"its placeholder block has {end - start} pad tokens, the processed image (grid {image_grid}, "
                f"merge {spec.spatial_merge_size}) needs {needed}: the image or the processor is not the one the "
                "server used",
                row.rollout_id,
            )
    return {"pixel_values": pixel_values, "image_grid_thw": grid}


def vision_inputs(rows: Sequence[TrainingRow], spec: VisionSpec) -> list[dict[str, torch.Tensor]]:
    """Per row, the model's vision inputs: ``{}`` for a row without images, else ``pixel_values``
    (the image processor's, ``(patches, channels·temporal·patch²)``) and ``image_grid_thw``
    (``(n_images, 3)`` int64). A row whose placeholder blocks do not match its images (their count,
    or a block's pad count against ``t·h·w / merge²``) is a :class:`DataValidationError` naming the
    rollout and ``image_urls``."""
    return [_row_inputs(row, spec) if row.image_urls else {} for row in rows]
