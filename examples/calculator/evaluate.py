"""Held-out accuracy of a policy on the calculator task: every problem of a split, decoded greedily.

The policy is served in-process by agl's policy server (the torch backend's engine), and each problem
runs the agent's own episode (:func:`examples.calculator.agent.solve`), so what is scored is exactly
what training rewards. Problems run concurrently, so the server decodes them as batches.

Usage: ``python examples/calculator/evaluate.py MODEL_DIR [--split test] [--limit N] [--out FILE]``.
Prints the accuracy, the share of episodes that called the calculator, and the time taken; ``--out``
writes one JSON line per problem (its conversation, answer and reward).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from agl_core.serving.models import load_policy_model  # noqa: E402
from agl_core.serving.policy_server import PolicyServer  # noqa: E402
from agl_core.serving.sampling import SamplingParams  # noqa: E402
from examples.calculator.agent import MAX_TOKENS, solve  # noqa: E402
from examples.calculator.task import first_messages  # noqa: E402

HERE = Path(__file__).parent


def evaluate(model_dir: Path, problems: list[dict], temperature: float = 0.0, concurrency: int = 64) -> list[dict]:
    """Each problem with its greedy episode: ``reward``, ``called_tool`` and ``messages``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    server = PolicyServer(load_policy_model(model_dir).eval(), tokenizer, str(model_dir), max_batch_size=concurrency)
    server.start()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature)

    def reply_to(messages: list[dict[str, str]]) -> str:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return server.generate(list(prompt), params).text

    def episode(problem: dict) -> dict:
        reward, messages = solve(problem["question"], int(problem["answer"]), reply_to)
        called = any(m["role"] == "user" for m in messages[len(first_messages("")) :])
        return {**problem, "reward": reward, "called_tool": called, "messages": messages}

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(episode, problems))
    finally:
        server.close()


def score(results: list[dict]) -> dict:
    """How many problems, the share answered exactly and the share that called the calculator."""
    n = len(results)
    return {
        "problems": n,
        "accuracy": sum(r["reward"] for r in results) / n,
        "called_tool": sum(r["called_tool"] for r in results) / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--split", default="test", help="train, val or test (default: test, never trained on)")
    parser.add_argument("--limit", type=int, help="only the split's first N problems")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--out", type=Path, help="write each problem's episode here (JSON lines)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    problems = [json.loads(line) for line in (HERE / f"{args.split}.jsonl").read_text().splitlines()]
    problems = problems[: args.limit]
    start = time.perf_counter()
    results = evaluate(args.model_dir, problems, args.temperature)
    seconds = time.perf_counter() - start
    summary = {"model": str(args.model_dir), "split": args.split, "temperature": args.temperature}
    print(json.dumps({**summary, **score(results), "seconds": round(seconds, 1)}))
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
