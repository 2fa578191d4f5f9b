"""The calculator agent, written against the Agent Lightning agent contract.

It is started as ``examples.calculator.agent:CalculatorAgent().run()``, under agl's embedded rollout
source or under the real gateway + controller, and reads the problem from its environment
(``CALC_QUESTION`` and ``CALC_ANSWER``, mapped from the rollout input by ``agentlightning.local.env_map``).
Each reply is one model call; a reply that calls the calculator gets the result back as a user
message (see ``task.py``). The reward, 1 for the exact final answer, is reported once at the end.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from examples.agent_http import chat, post_rewards
from examples.calculator.task import MAX_TURNS, calculate, final_answer, first_messages, observation, tool_call

MAX_TOKENS = 48  # a call or an answer is a dozen tokens; a reply that rambles is cut here


def solve(question: str, answer: int, reply_to: Callable[[list[dict[str, str]]], str]) -> tuple[float, list[dict]]:
    """One episode: the reward and the conversation, the model answering through ``reply_to``."""
    messages = first_messages(question)
    for _ in range(MAX_TURNS):
        reply = reply_to(messages)
        messages.append({"role": "assistant", "content": reply})
        expression = tool_call(reply)
        if expression is None:
            return float(final_answer(reply) == answer), messages
        messages.append({"role": "user", "content": observation(calculate(expression))})
    return 0.0, messages


class CalculatorAgent:
    def run(self) -> float:
        reward, _ = solve(
            os.environ["CALC_QUESTION"],
            int(os.environ["CALC_ANSWER"]),
            lambda messages: chat(messages, max_tokens=MAX_TOKENS),
        )
        post_rewards({"value": reward})
        return reward
