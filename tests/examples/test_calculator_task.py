"""The calculator example's task: its splits, the tool and the reading of replies (no model)."""

from __future__ import annotations

import json

import pytest

from examples.calculator.agent import solve
from examples.calculator.task import MAX_TURNS, calculate, final_answer, make_splits, tool_call
from tests.helpers.paths import REPO_ROOT

CALCULATOR = REPO_ROOT / "examples" / "calculator"


def test_the_committed_splits_are_the_generated_ones_and_share_no_problem():
    splits = make_splits()
    for name, problems in splits.items():
        rows = [json.loads(line) for line in (CALCULATOR / f"{name}.jsonl").read_text().splitlines()]
        assert [(r["question"], r["answer"]) for r in rows] == [(p.question, p.answer) for p in problems], name
    questions = [{p.question for p in problems} for problems in splits.values()]
    assert sum(map(len, questions)) == len(set().union(*questions))


@pytest.mark.parametrize(
    ("expression", "result"),
    [("14 * 6", "84"), ("(3 + 4) * 2", "14"), ("7 / 2", "3.5"), ("-5 + 2", "-3"), ("12 × 3", "36")],
)
def test_the_calculator_computes(expression, result):
    assert calculate(expression) == result


@pytest.mark.parametrize("expression", ["", "2 **", "__import__('os')", "2 ** 3", "1 / 0", "x + 1", "9" * 20])
def test_the_calculator_answers_anything_else_with_an_error_message(expression):
    assert calculate(expression).startswith("error: ")


@pytest.mark.parametrize(
    ("reply", "call", "answer"),
    [
        ("<calc>14 * 6</calc>", "14 * 6", None),
        ("I will compute <calc>2+3</calc> then <calc>1+1</calc>", "2+3", 1),
        ("Answer: 84", None, 84),
        ("<calc>14 * 6</calc> Answer: 1,084", None, 1084),
        ("So 3 + 4 = 7 sheep.", None, 7),
        ("I do not know.", None, None),
    ],
)
def test_a_reply_is_a_tool_call_or_a_final_answer(reply, call, answer):
    assert tool_call(reply) == call
    if call is None:
        assert final_answer(reply) == answer


def _scripted(replies):
    replies = iter(replies)
    return lambda messages: next(replies)


def test_an_episode_calls_the_tool_reads_its_result_and_is_rewarded_for_the_exact_answer():
    seen = []

    def reply_to(messages):
        seen.append(messages[-1]["content"])
        return "<calc>31 + 21</calc>" if len(seen) == 1 else "Answer: 52"

    reward, messages = solve("How many sheep?", 52, reply_to)
    assert reward == 1.0
    assert seen == ["How many sheep?", "Calculator result: 52"]
    assert solve("How many sheep?", 53, _scripted(["<calc>31 + 21</calc>", "Answer: 52"]))[0] == 0.0


def test_an_episode_still_calling_the_tool_after_the_last_turn_earns_nothing():
    reward, messages = solve("q", 2, _scripted(["<calc>1 + 1</calc>"] * MAX_TURNS))
    assert reward == 0.0
    assert [m["role"] for m in messages[-2:]] == ["assistant", "user"]
