"""Peak memory of the update's log-probs and entropy at a real vocabulary: the full log-softmax
against the chunked head (:func:`agl_core.backends.ppo.response_stats`), side by side in one run (CPU).

One forward and backward pass of ``-mean(log-prob) - 0.01 × mean(entropy)`` over one row of a
16-token prompt and ``T`` response tokens, through a random Llama whose body is small (hidden 64, one
layer) so that the vocabulary's tensors are what the pass holds. The full side is the computation the
update made before its head was chunked: the model's logits at every response position, their float32
log-softmax ``[rows, T, vocab]``, the chosen tokens' log-probs and the entropy from it. Each case runs
in its own process; its peak RSS (``ru_maxrss``) is that process's, including what importing torch
and transformers and building the model took (``setup``, the peak before the pass). ``[T, vocab] f32``
is the size of one ``[rows, T, vocab]`` float32 tensor. The two sides' losses are checked equal (to
1e-4).

The full side's peak is about 6 ``[T, vocab]`` tensors over its setup (measured from 1,024 to 4,096
tokens; 6.5 are assumed): a case whose full side would leave less than 4 GiB of the machine's
available memory runs the chunked side only.

    python benchmarks/bench_vocab_memory.py          # 1,024 and 2,048 tokens, both vocabularies
    python benchmarks/bench_vocab_memory.py --full   # 1,024 to 8,192 tokens
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

VOCABS = (49_152, 151_936)
PROMPT = 16
FULL_SIDE_TENSORS = 6.5
"""The full side's peak over its setup, in ``[T, vocab]`` float32 tensors (about 6 measured)."""
HEADROOM_MIB = 4096
"""What a full side leaves of the available memory, for whatever else the machine runs."""


def run_case(side: str, vocab: int, length: int) -> dict[str, float]:
    """One forward and backward pass of ``side`` in this process: its loss and the peak RSS."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agl_core.backends.ppo import model_inputs, response_stats

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (1, PROMPT + length))
    tensors = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(ids.shape[1])[None],
        "responses": ids[:, PROMPT:],
    }
    setup_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if side == "full":
        logits = model(**model_inputs(tensors), use_cache=False, logits_to_keep=length + 1).logits[:, :-1]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        log_prob = log_probs.gather(-1, tensors["responses"][..., None]).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    else:
        stats = response_stats(model, tensors)
        log_prob, entropy = stats.log_prob, stats.entropy
    loss = -log_prob.mean() - 0.01 * entropy.mean()
    loss.backward()
    return {
        "loss": loss.item(),
        "setup_mib": setup_mib,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def child(side: str, vocab: int, length: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", side, str(vocab), str(length)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def available_mib() -> float:
    """The memory the machine can still give a process (``MemAvailable``)."""
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="response lengths 1,024 to 8,192 (default: 1,024, 2,048)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        side, vocab, length = args.child
        print(json.dumps(run_case(side, int(vocab), int(length))))
        return
    lengths = (1024, 2048, 4096, 8192) if args.full else (1024, 2048)
    print("| vocab | T | [T, vocab] f32 MiB | setup MiB | full peak RSS MiB | chunked peak RSS MiB | full / chunked |")
    print("|---|---|---|---|---|---|---|")
    for vocab in VOCABS:
        for length in lengths:
            tensor_mib = length * vocab * 4 / 2**20
            chunked = child("chunked", vocab, length)
            need = chunked["setup_mib"] + FULL_SIDE_TENSORS * tensor_mib
            if need + HEADROOM_MIB > available_mib():
                full_peak, ratio = f"not run (needs ~{need / 1024:.0f} GiB)", ""
            else:
                full = child("full", vocab, length)
                if abs(full["loss"] - chunked["loss"]) > 1e-4:
                    raise SystemExit(f"the sides' losses differ at vocab {vocab}, T {length}: {full} {chunked}")
                full_peak, ratio = f"{full['peak_mib']:,.0f}", f"{full['peak_mib'] / chunked['peak_mib']:.1f}"
            print(
                f"| {vocab:,} | {length:,} | {tensor_mib:,.0f} | {chunked['setup_mib']:,.0f} | {full_peak}"
                f" | {chunked['peak_mib']:,.0f} | {ratio} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
