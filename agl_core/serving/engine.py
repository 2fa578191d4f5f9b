"""The interface between a training backend and the server that generates with the policy.

The reference backend serves its policy either in-process (:mod:`agl_core.serving.policy_server`) or through
a real vLLM server (:mod:`agl_core.serving.vllm_engine`); both answer OpenAI-compatible requests the way vLLM
does for RL gateways (token ids and per-token log-probs in every response), so agents, the gateway
and every stage downstream cannot tell them apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["InferenceEngine"]


class InferenceEngine(Protocol):
    model_name: str
    """The served model name; it must equal what the gateway has registered."""

    @property
    def base_url(self) -> str:
        """OpenAI base URL (``http://127.0.0.1:PORT/v1``) of the server."""

    def start(self) -> None:
        """Start serving (idempotent); return once the server answers requests."""

    def push_weights(self, model: torch.nn.Module, version: int) -> None:
        """Make the server generate with ``model``'s current weights from now on.

        ``model`` is the trainer's module (a Hugging Face causal LM); ``version`` the training step
        the weights belong to. When this returns, no request is answered with older weights (and no
        cached prompt state computed with them is reused).
        """

    def sampler_state(self) -> object | None:
        """The random state the server samples with, for a checkpoint (so a resumed run samples as
        an uninterrupted one would); ``None`` when the server's sampling cannot be restored."""

    def restore_sampler_state(self, state: object) -> None:
        """Continue sampling from a state :meth:`sampler_state` returned (never ``None``)."""

    def close(self) -> None:
        """Stop the server and free what it holds."""
