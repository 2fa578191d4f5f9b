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
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.corridor.task import vocabulary_corpus  # noqa: E402

DEFAULT_DIR = Path("outputs/corridor/policy")
BODY_INIT_STD = 0.08
HEAD_INIT_STD = 0.02
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    corpus = [*vocabulary_corpus(), "system user assistant"]
    tokenizer.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="[UNK]",
        chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        initializer_range=BODY_INIT_STD,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, HEAD_INIT_STD)
    return model


def build(out_dir: Path, seed: int = 0) -> Path:
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"built the corridor policy in {build(args.out_dir, args.seed)}")


if __name__ == "__main__":
    main()
