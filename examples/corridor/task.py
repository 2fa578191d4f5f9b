"""The corridor task: walk through junctions, turning the way each junction's sign points.

An episode has ``len(signs)`` junctions. At each one the agent is told which way the sign points
and must answer ``left`` or ``right``; it then hears whether the turn was right and reaches the next
junction. The right action at a turn depends only on the observation just before it, so the policy
must read each observation; the reward is the fraction of right turns.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

DIRECTIONS = ("left", "right")
SYSTEM_PROMPT = "you walk a corridor . at each junction answer left or right ."


def observation(junction: int, sign: str, previous_correct: bool | None) -> str:
    """What the agent is told on reaching ``junction`` (1-based)."""
    feedback = "" if previous_correct is None else ("correct . " if previous_correct else "wrong . ")
    return f"{feedback}junction {junction} : the sign points {sign}"


def action(reply: str) -> str | None:
    """The direction the reply chose: its first word, if that is a direction."""
    words = reply.split()
    return words[0] if words and words[0] in DIRECTIONS else None


def vocabulary_corpus() -> list[str]:
    """Every text the task can show, for training the tiny policy's tokenizer."""
    lines = [SYSTEM_PROMPT]
    for junction in range(1, 10):
        for sign in DIRECTIONS:
            for previous in (None, True, False):
                lines.append(observation(junction, sign, previous))
    return lines


def make_dataset(path: Path, n_rows: int, n_junctions: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n_rows):
            signs = [rng.choice(DIRECTIONS) for _ in range(n_junctions)]
            f.write(json.dumps({"id": i, "signs": signs}) + "\n")


if __name__ == "__main__":
    # python examples/corridor/task.py [DIR]: the training rows (dataset.jsonl) and validation rows (val.jsonl)
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    make_dataset(out / "dataset.jsonl", 256, 3, 0)
    make_dataset(out / "val.jsonl", 32, 3, 1)
