"""The soak benchmark's agent: the corridor agent, some of whose runs crash or dawdle on purpose.

It runs in the controller's Python (the gateway venv), so it imports only the corridor agent. Which
runs misbehave follows from the rollout id (a hash), at the rates the benchmark puts in the
controller's environment: ``SOAK_CRASH_RATE`` (the process dies after its first model call, as an
agent killed by the OOM killer would), ``SOAK_SLOW_RATE`` and ``SOAK_SLOW_SECONDS`` (it waits that
long before starting).
"""

from __future__ import annotations

import json
import os
import time
import zlib

from examples.corridor import agent as corridor

__all__ = ["SoakAgent"]

CRASH_EXIT_CODE = 17


def _draw(salt: str) -> float:
    """A number in [0, 1) fixed by this rollout's id (taken from its event URL) and ``salt``."""
    rollout_id = os.environ["AGL_EVENT_URL"].split("/api/rollouts/")[1].split("/")[0]
    return zlib.crc32(f"{salt}:{rollout_id}".encode()) / 2**32


class SoakAgent(corridor.CorridorAgent):
    def run(self) -> float:
        if _draw("slow") < float(os.environ.get("SOAK_SLOW_RATE", "0")):
            time.sleep(float(os.environ.get("SOAK_SLOW_SECONDS", "0")))
        if _draw("crash") < float(os.environ.get("SOAK_CRASH_RATE", "0")):
            first_sign = json.loads(os.environ["CORRIDOR_SIGNS"])[0]
            messages = [
                {"role": "system", "content": corridor.SYSTEM_PROMPT},
                {"role": "user", "content": corridor.observation(1, first_sign, None)},
            ]
            headers = {"Authorization": f"Bearer {os.environ.get('AGL_KEY', '')}"}
            corridor._chat(os.environ["AGL_OPENAI_BASE_URL"].rstrip("/") + "/chat/completions", headers, messages)
            os._exit(CRASH_EXIT_CODE)
        return super().run()
