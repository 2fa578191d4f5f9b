"""Agents for the embedded source, named by ``agentlightning.local.agent_class=tests.helpers.agents:...``."""

from __future__ import annotations

import httpx


class FailingAgent:
    """Raises in its environment, as a broken agent does."""

    def run(self):
        raise RuntimeError("the environment broke")


class NoisyRewardAgent:
    """One model call, then a random reward: every group has reward variance, so a step must learn."""

    def run(self):
        import os
        import random

        headers = {"Authorization": f"Bearer {os.environ['AGL_KEY']}"}
        messages = [{"role": "user", "content": "junction 1 : the sign points left"}]
        body = {"model": "policy", "messages": messages, "max_tokens": 3}
        httpx.post(
            f"{os.environ['AGL_OPENAI_BASE_URL']}/chat/completions", json=body, headers=headers, timeout=60
        ).raise_for_status()
        data = {"value": random.random()}
        httpx.post(
            os.environ["AGL_EVENT_URL"], headers=headers, json={"event_type": "reward", "data": data}
        ).raise_for_status()
