"""Small chat policies built locally, for tests, examples and benchmarks: nothing is downloaded.

The tokenizer is word-level, trained on the texts a task shows, so a reply re-rendered by the chat
template tokenizes exactly as it was generated (trajectory aggregation then merges a conversation
into one row). The model is a Llama with random weights, sized by the caller: Llama's model type has
no tokenizer class of its own, so ``AutoTokenizer`` loads ``tokenizer.json`` as saved.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "llama_policy", "save_policy", "word_tokenizer"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def word_tokenizer(corpus: Iterable[str], vocab_size: int | None = None) -> Any:
    """A ``PreTrainedTokenizerFast`` with one token per word of ``corpus`` (at most ``vocab_size``
    tokens), the special tokens above and the chat template; ``<|im_end|>`` ends a reply."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    options = {} if vocab_size is None else {"vocab_size": vocab_size}
    words.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, **options))
    return PreTrainedTokenizerFast(
        tokenizer_object=words,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="[UNK]",
        chat_template=CHAT_TEMPLATE,
    )


def llama_policy(tokenizer: Any, seed: int, **config: Any) -> Any:
    """A ``LlamaForCausalLM`` drawn after ``torch.manual_seed(seed)``, with ``tokenizer``'s vocabulary
    and end, pad (and no bos) tokens; ``config`` holds the other ``LlamaConfig`` keywords (sizes,
    ``initializer_range``...)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), bos_token_id=None, **ids, **config))
    model.generation_config.eos_token_id = ids["eos_token_id"]
    model.generation_config.pad_token_id = ids["pad_token_id"]
    return model


def save_policy(out_dir: Path, model: Any, tokenizer: Any) -> Path:
    """Save ``model`` and ``tokenizer`` (with its chat template) in ``out_dir``, a model folder any
    backend, and vLLM, can load."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
