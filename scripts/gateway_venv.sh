#!/usr/bin/env bash
# Build the Python 3.12 venv that runs the real Agent Lightning gateway (agl-server, agl-controller).
# agentlightning needs Python >= 3.12; the project itself runs on 3.11. Idempotent.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${AGL_GATEWAY_VENV:-$root/.venvs/gateway}"
if [ -x "$venv/bin/agl-server" ]; then
  echo "gateway venv ready: $venv"
  exit 0
fi
py312="${AGL_PYTHON312:-$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python}"
if [ ! -x "$py312" ]; then
  py312="$(command -v python3.12 || true)"
fi
if [ -z "$py312" ] || [ ! -x "$py312" ]; then
  echo "no Python 3.12 found (set AGL_PYTHON312)" >&2
  exit 1
fi
"$py312" -m venv "$venv"
# --no-compile: Python compiles what a run imports, a fraction of the venv's modules (vLLM's alone
# holds ~22,000 .py files), instead of pip compiling them all at install.
"$venv/bin/pip" install -q --no-compile agentlightning==1.0.2
echo "gateway venv built: $venv"
