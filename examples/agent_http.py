"""What the example agents share: one pooled HTTP client, and a chat call that waits out a paused gateway.

An agent learns its endpoints from the Agent Lightning contract's environment (``AGL_OPENAI_BASE_URL``,
``AGL_EVENT_URL``, ``AGL_KEY``); :func:`chat` calls the first, :func:`post_rewards` the second.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx

MAX_PAUSED_WAITS = 60  # a paused gateway (weight update) answers 429 with Retry-After; wait that out

# One connection pool per process: the controller starts a process per rollout, the embedded source
# runs many rollouts in one process. The pool never trims its idle connections: httpcore 1.0's pool
# can close a connection it has just handed to another thread when it drops surplus or expired
# keep-alive connections (encode/httpcore#1110), and that call then fails or hangs until its timeout.
_client = httpx.Client(
    timeout=300, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=None)
)


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {os.environ.get('AGL_KEY', '')}"}


def chat(messages: list[dict[str, str]], **params: Any) -> str:
    """The reply to ``messages`` from this rollout's model endpoint (``params``: max_tokens, stop...)."""
    url = os.environ["AGL_OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
    for _ in range(MAX_PAUSED_WAITS):
        response = _client.post(url, headers=_headers(), json={"model": "policy", "messages": messages, **params})
        if response.status_code != 429:
            break
        time.sleep(float(response.headers.get("Retry-After", "1")))
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def post_rewards(*data: dict[str, Any]) -> None:
    """Report each reward event (``{"value": r}``, optionally tagged with ``call_index``) to the gateway."""
    for item in data:
        response = _client.post(
            os.environ["AGL_EVENT_URL"], headers=_headers(), json={"event_type": "reward", "data": item}
        )
        response.raise_for_status()
