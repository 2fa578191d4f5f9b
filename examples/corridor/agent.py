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

from examples.agent_http import chat, post_rewards
from examples.corridor.task import SYSTEM_PROMPT, action, observation

MAX_TOKENS = 1  # the direction word; see the module docstring


class CorridorAgent:
    def run(self) -> float:
        signs = json.loads(os.environ["CORRIDOR_SIGNS"])
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        correct = None
        n_correct = 0
        rewards = []
        for junction, sign in enumerate(signs, start=1):
            messages.append({"role": "user", "content": observation(junction, sign, correct)})
            reply = chat(messages, max_tokens=MAX_TOKENS)
            messages.append({"role": "assistant", "content": reply})
            correct = action(reply) == sign
            n_correct += correct
            rewards.append({"value": (1.0 if correct else 0.0) / len(signs), "call_index": junction - 1})
        reward = n_correct / len(signs)
        post_rewards(*rewards, {"value": reward})
        return reward
