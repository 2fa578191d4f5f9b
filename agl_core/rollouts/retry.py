"""When a gateway call is sent again, how long to wait first, and the one loop that does it.

One :class:`RetryPolicy` per gateway client, built from ``agentlightning.gateway.{max_retries,
retry_backoff_seconds, retry_backoff_max_seconds}``. Every gateway call goes through
:meth:`RetryPolicy.run`; the error it finally raises says whether the failure was transient
(``GatewayError.transient``), which is all a gateway source reads: no source asks the policy, or
wraps a call in a retry loop of its own.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

import attrs
import httpx
from omegaconf import DictConfig

from agl_core.config.schema import GatewayConfig
from agl_core.rollouts.gateway_error import GatewayError

__all__ = ["RetryPolicy"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@attrs.frozen
class RetryPolicy:
    """An idempotent call is retried on a timeout, a connection error or a ``retryable_status``
    answer; a call that is not idempotent only when the gateway provably did not apply it: the
    request never left (``unsent_errors``) or the answer is a ``not_applied_status``. Each call makes
    at most ``max_retries + 1`` attempts, waiting a jittered exponential backoff between them. The
    defaults are the config schema's (``agentlightning.gateway``)."""

    max_retries: int = attrs.field(default=GatewayConfig.max_retries, validator=attrs.validators.ge(0))
    backoff_seconds: float = attrs.field(default=GatewayConfig.retry_backoff_seconds, validator=attrs.validators.ge(0))
    backoff_max_seconds: float = attrs.field(
        default=GatewayConfig.retry_backoff_max_seconds, validator=attrs.validators.ge(0)
    )
    retryable_status: frozenset[int] = frozenset({408, 429}) | frozenset(range(500, 600))
    not_applied_status: frozenset[int] = frozenset({408, 429, 503})
    unsent_errors: tuple[type[httpx.TransportError], ...] = (
        httpx.ConnectError,
        httpx.ConnectTimeout,
        httpx.PoolTimeout,
    )

    @classmethod
    def from_config(cls, config: DictConfig) -> RetryPolicy:
        gateway = config.agentlightning.gateway
        return cls(
            max_retries=int(gateway.max_retries),
            backoff_seconds=float(gateway.retry_backoff_seconds),
            backoff_max_seconds=float(gateway.retry_backoff_max_seconds),
        )

    def backoff(self, retry: int) -> float:
        """The jittered wait before retry number ``retry + 1``."""
        return min(self.backoff_max_seconds, self.backoff_seconds * 2**retry) * random.uniform(0.5, 1.0)

    def unsent(self, error: httpx.TransportError) -> bool:
        """Whether the request provably never reached the gateway."""
        return isinstance(error, self.unsent_errors)

    def is_retryable(self, error: GatewayError, *, idempotent: bool = True) -> bool:
        """Whether sending the failed call again is safe and may succeed."""
        if error.status is None:
            return idempotent or not error.ambiguous
        return error.status in (self.retryable_status if idempotent else self.not_applied_status)

    def run(
        self, attempt: Callable[[], T], *, idempotent: bool = True, on_retry: Callable[[], None] | None = None
    ) -> T:
        """Call ``attempt`` until it succeeds, its failure is final, or the attempts run out; call
        ``on_retry`` before each retry. The :class:`GatewayError` raised in the end has ``transient``
        set: whether an idempotent call failing so would have been retried."""
        retries = 0
        while True:
            try:
                return attempt()
            except GatewayError as error:
                if retries >= self.max_retries or not self.is_retryable(error, idempotent=idempotent):
                    error.transient = self.is_retryable(error)
                    raise
                delay = self.backoff(retries)
                retries += 1
                if on_retry is not None:
                    on_retry()
                logger.warning("%s; retry %d/%d in %.2fs", error, retries, self.max_retries, delay)
                time.sleep(delay)
