"""A tensorised batch cut into token-budget micro-batches, each padded only to its own widths.

:func:`split` groups the batch's rows with :func:`agl_core.stages.micro_batches.micro_batches` and
:meth:`MicroBatch.cut` takes a group's rows out of the batch's tensors, keeping only the columns its
longest prompt and response reach. In :func:`agl_core.stages.tensorize.tensorize`'s layout prompts are
left-padded and responses right-padded, so the columns cut away hold only padding, and the result
equals tensorising the group's rows with those widths.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from agl_core.stages.micro_batches import micro_batches

__all__ = ["MicroBatch", "split"]

# The tensors holding prompt and response side by side; ``prompts`` holds the prompt alone, every other
# tensor is aligned with the responses.
SEQUENCE_TENSORS = frozenset({"input_ids", "attention_mask", "position_ids"})


@attrs.frozen
class MicroBatch:
    """Rows of a batch (indices, ascending) and the prompt / response widths they are padded to."""

    rows: torch.Tensor
    prompt_length: int
    response_length: int

    def cut(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """These rows of ``tensors`` (a tensorised batch), padded only to this micro-batch's widths."""
        prompt_width = tensors["prompts"].shape[1]
        start, end = prompt_width - self.prompt_length, prompt_width + self.response_length
        out = {}
        for name, value in tensors.items():
            # Columns first (a view), then rows: only the micro-batch's own widths are copied.
            if name == "prompts":
                out[name] = value[:, start:][self.rows]
            elif name in SEQUENCE_TENSORS:
                out[name] = value[:, start:end][self.rows]
            else:
                out[name] = self.cut_responses(value)
        return out

    def cut_responses(self, values: torch.Tensor) -> torch.Tensor:
        """These rows of a response-aligned ``[rows, response_len]`` tensor (advantages, log-probs),
        cut like the responses in :meth:`cut`."""
        return values[:, : self.response_length][self.rows]


def split(tensors: Mapping[str, torch.Tensor], max_tokens: int, key: str) -> list[MicroBatch]:
    """The batch's rows in micro-batches of at most ``max_tokens`` padded elements; ``key`` names the
    budget in the error for a row longer than it."""
    prompt_width = tensors["prompts"].shape[1]
    attention = tensors["attention_mask"]
    prompts = attention[:, :prompt_width].sum(1).cpu().numpy()
    responses = attention[:, prompt_width:].sum(1).cpu().numpy()
    return [
        MicroBatch(
            torch.as_tensor(group, device=attention.device), int(prompts[group].max()), int(responses[group].max())
        )
        for group in micro_batches(prompts, responses, max_tokens, key=key)
    ]
