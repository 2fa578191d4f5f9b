"""The corridor agent, written against the Agent Lightning agent contract.

It is started as ``examples.corridor.agent:CorridorAgent().run()`` and learns everything from its
environment: ``AGL_OPENAI_BASE_URL`` (an OpenAI-compatible base URL for this rollout),
``AGL_EVENT_URL`` (where to post its reward), ``AGL_KEY`` (the bearer key) and ``CORRIDOR_SIGNS``
(the rollout input's ``signs``, mapped by ``agentlightning.local.env_map``). The same class runs
under agl's embedded rollout source and under the real gateway + controller.

Besides the final reward (the fraction of right turns) it reports each junction's own reward,
``1 / len(signs)`` for a right turn and 0 otherwise, tagged with the model call that made the turn
(``data.call_index``), so a turn-aware estimator (``turn_grpo``) can credit each turn for itself.

Each reply is one token: the turn is decided by the reply's first word, and tokens after it earn
nothing, so a policy would fill them with whatever it likes, special tokens included. Those vanish
from the reply text, the re-rendered history no longer extends the tokens the model produced, and
trajectory aggregation has to split the rollout. With one token the chat template closes every turn,
and each rollout merges into one row once the policy answers with words.
"""

from __future__ import annotations

import json
import os
import time

import httpx

from examples.corridor.task import SYSTEM_PROMPT, action, observation

MAX_TOKENS = 1  # the direction word; see the module docstring
MAX_PAUSED_WAITS = 60  # a paused gateway (weight update) answers 429 with Retry-After; wait that out

# One connection pool per process: the controller starts a process per rollout, the embedded source
# runs many rollouts in one process. The pool never trims its idle connections: httpcore 1.0's pool
# can close a connection it has just handed to another thread when it drops surplus or expired
# keep-alive connections (encode/httpcore#1110), and that call then fails or hangs until its timeout.
_client = httpx.Client(
    timeout=300, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=None)
)


class CorridorAgent:
    def run(self) -> float:
        base_url = os.environ["AGL_OPENAI_BASE_URL"].rstrip("/")
        event_url = os.environ["AGL_EVENT_URL"]
        headers = {"Authorization": f"Bearer {os.environ.get('AGL_KEY', '')}"}
        signs = json.loads(os.environ["CORRIDOR_SIGNS"])
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        correct = None
        n_correct = 0
        rewards = []
        for junction, sign in enumerate(signs, start=1):
            messages.append({"role": "user", "content": observation(junction, sign, correct)})
            response = _chat(f"{base_url}/chat/completions", headers, messages)
            reply = response.json()["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": reply})
            correct = action(reply) == sign
            n_correct += correct
            rewards.append({"value": (1.0 if correct else 0.0) / len(signs), "call_index": junction - 1})
        reward = n_correct / len(signs)
        for data in [*rewards, {"value": reward}]:
            _client.post(event_url, headers=headers, json={"event_type": "reward", "data": data}).raise_for_status()
        return reward


def _chat(url: str, headers: dict[str, str], messages: list[dict[str, str]]) -> httpx.Response:
    """One chat call; while the gateway is paused for a weight update, retry after the wait it asks for."""
    for _ in range(MAX_PAUSED_WAITS):
        response = _client.post(
            url, headers=headers, json={"model": "policy", "messages": messages, "max_tokens": MAX_TOKENS}
        )
        if response.status_code != 429:
            break
        time.sleep(float(response.headers.get("Retry-After", "1")))
    response.raise_for_status()
    return response
