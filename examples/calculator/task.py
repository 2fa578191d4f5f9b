"""The calculator task: arithmetic word problems an agent solves with a calculator tool.

Each problem is a short story around two numbers and one operation (+, -, ×), generated from a seed.
The agent may call the calculator by writing ``<calc>EXPRESSION</calc>`` in a reply; the tool's
result comes back as the next user message, and the agent replies again. A reply without a call ends
the episode, and its answer is the number after ``Answer:`` (else the last number in it). The reward
is 1 for the exact answer, 0 otherwise, and 0 for an episode that is still calling the tool after
``MAX_TURNS`` replies.

Splits come from different seeds and never share a problem: ``train.jsonl`` (trained on),
``val.jsonl`` (validated on during training) and ``test.jsonl`` (held out, only evaluated).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import operator
import random
import re
import sys
from pathlib import Path

SYSTEM_PROMPT = (
    "You solve arithmetic word problems with a calculator. To use it, write the calculation inside "
    "<calc></calc> tags, for example <calc>23 * 7</calc>, and nothing else; the result comes back in the "
    "next message. When you know the result, reply with Answer: followed by the number, for example "
    "Answer: 161."
)
# One solved problem shown as earlier turns of the conversation: a small model copies a format it has
# seen in its own chat turns far more readily than one described in words.
DEMONSTRATION = (
    {"role": "user", "content": "A crate holds 14 melons. How many melons are in 6 crates?"},
    {"role": "assistant", "content": "<calc>14 * 6</calc>"},
    {"role": "user", "content": "Calculator result: 84"},
    {"role": "assistant", "content": "Answer: 84"},
)
MAX_TURNS = 3  # model calls per episode: a call, the answer, and one retry

# (operation, story): the story names the numbers {a} and {b}; the answer is a OP b.
STORIES = (
    ("+", "A farmer has {a} sheep and buys {b} more. How many sheep does the farmer have now?"),
    ("+", "A library holds {a} books and receives {b} new ones. How many books does it hold now?"),
    ("+", "Tom walked {a} steps in the morning and {b} steps in the evening. How many steps did he walk?"),
    ("-", "A shop had {a} apples and sold {b} of them. How many apples are left?"),
    ("-", "A bus carries {a} people and {b} get off at a stop. How many people are still on the bus?"),
    ("-", "Mia had {a} stickers and gave {b} to her brother. How many stickers does Mia have left?"),
    ("*", "A box holds {b} pencils. How many pencils are in {a} boxes?"),
    ("*", "A ticket costs {b} dollars. How much do {a} tickets cost in dollars?"),
    ("*", "Each row of a garden has {b} plants. How many plants are in {a} rows?"),
)
OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
SPLITS = {"train": (0, 1000), "val": (1, 32), "test": (2, 256)}  # name: (seed, rows)

_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_ANSWER = re.compile(r"Answer:\s*(-?[\d,]+)")
_NUMBER = re.compile(r"-?\d[\d,]*")


@dataclasses.dataclass(frozen=True)
class Problem:
    question: str
    answer: int


def draw_problem(rng: random.Random) -> Problem:
    op, story = rng.choice(STORIES)
    if op == "*":
        a, b = rng.randint(3, 19), rng.randint(12, 49)
    else:
        a, b = rng.randint(20, 99), rng.randint(11, 99)
        if op == "-" and b > a:
            a, b = b, a
    return Problem(story.format(a=a, b=b), OPERATIONS[op](a, b))


def make_splits() -> dict[str, list[Problem]]:
    """Every split's problems; a question drawn for an earlier split is drawn again for a later one."""
    seen: set[str] = set()
    splits = {}
    for name, (seed, rows) in SPLITS.items():
        rng = random.Random(seed)
        problems: list[Problem] = []
        while len(problems) < rows:
            problem = draw_problem(rng)
            if problem.question not in seen:
                seen.add(problem.question)
                problems.append(problem)
        splits[name] = problems
    return splits


def tool_call(reply: str) -> str | None:
    """The expression of the reply's first calculator call, or None when it calls no tool."""
    if _ANSWER.search(reply):
        return None
    match = _CALL.search(reply)
    return match.group(1) if match else None


def final_answer(reply: str) -> int | None:
    """The reply's answer: the number after ``Answer:``, else the last number in it."""
    match = _ANSWER.search(reply)
    numbers = [match.group(1)] if match else _NUMBER.findall(reply)
    if not numbers:
        return None
    try:
        return int(numbers[-1].replace(",", ""))
    except ValueError:
        return None


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The calculator: ``+ - * /`` and parentheses over numbers; anything else is an error message."""
    try:
        value = _evaluate(ast.parse(expression.replace("×", "*").strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError):
        return "error: the calculator reads numbers, + - * / and parentheses"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float) and abs(node.value) < 1e12:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError(ast.dump(node))


def first_messages(question: str) -> list[dict[str, str]]:
    """The conversation an episode starts from: the instructions, the demonstration, the problem."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, *DEMONSTRATION, {"role": "user", "content": question}]


def observation(result: str) -> str:
    """The user message that carries the calculator's result back to the agent."""
    return f"Calculator result: {result}"


def write_splits(out: Path) -> None:
    for name, problems in make_splits().items():
        with (out / f"{name}.jsonl").open("w") as f:
            for i, p in enumerate(problems):
                f.write(json.dumps({"id": f"{name}-{i}", "question": p.question, "answer": p.answer}) + "\n")


if __name__ == "__main__":
    # python examples/calculator/task.py [DIR]: writes train.jsonl, val.jsonl and test.jsonl
    write_splits(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
