"""Build the corridor task's tiny policy locally: random weights and a tokenizer trained on the fly.

Nothing is downloaded. The tokenizer is word-level (one token per word of the task's texts), so a
reply re-rendered by the chat template tokenizes exactly as it was generated and trajectory
aggregation merges each rollout into one row. The model is a 2-layer Llama with hidden size 128 and
4 heads (head size 32, which vLLM's attention needs), so the same folder loads in vLLM. Llama, whose
model type has no tokenizer class of its own, makes ``AutoTokenizer`` load ``tokenizer.json`` as
saved (a Qwen2 config would swap in Qwen2's byte-level pre-tokenizer).

The initialisation decides whether RL can teach this policy. With Llama's default (standard deviation
0.02 everywhere) attention starts uniform, the sign just shown barely moves the last hidden state and
the untrained policy answers alike in every context. RL then raises whichever direction word the
policy already favours, everywhere, until it says that word almost surely and the gradient through
its saturated softmax is gone: the reward stays near 0.5. So the body is drawn at 0.08, where the
sign already shapes the hidden state, and the output layer at 0.02, so the untrained policy favours
neither direction (each about 1 in 34).

Usage: ``python examples/corridor/build_policy.py [OUT_DIR] [--seed N]`` (default
``outputs/corridor/policy``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from agl_core.testing.word_policy import llama_policy, save_policy, word_tokenizer  # noqa: E402
from examples.corridor.task import vocabulary_corpus  # noqa: E402

DEFAULT_DIR = Path("outputs/corridor/policy")
BODY_INIT_STD = 0.08
HEAD_INIT_STD = 0.02


def build(out_dir: Path, seed: int = 0) -> Path:
    tokenizer = word_tokenizer([*vocabulary_corpus(), "system user assistant"])
    model = llama_policy(
        tokenizer,
        seed,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=BODY_INIT_STD,
    )
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, HEAD_INIT_STD)
    return save_policy(out_dir, model, tokenizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"built the corridor policy in {build(args.out_dir, args.seed)}")


if __name__ == "__main__":
    main()
