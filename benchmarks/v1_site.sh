#!/usr/bin/env bash
# Install Agent Lightning v1.0.2's trainer code into its own folder, for benchmarks/bench_vs_v1.py.
#
# agentlightning 1.0.2 declares Python >= 3.12, but the modules the benchmark imports (the rollout
# manager's data classes and verl's RolloutAdapter) import on 3.11. They need torch, numpy, pydantic,
# httpx, tensordict and verl, which the project's own environment already has, plus httpx-retries.
# Both go into a separate --target folder (never into the project's environment); the benchmark
# appends that folder to sys.path. Idempotent.
#
#   bash benchmarks/v1_site.sh            # -> .venvs/agentlightning-1.0.2
#   PYTHON=/path/to/python AGL_V1_SITE=/some/dir bash benchmarks/v1_site.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
site="${AGL_V1_SITE:-$root/.venvs/agentlightning-1.0.2}"
python="${PYTHON:-python}"
if [ -f "$site/agentlightning/verl/rollout_adapter.py" ] && [ -d "$site/httpx_retries" ]; then
  echo "agentlightning 1.0.2 ready: $site"
  exit 0
fi
"$python" -m pip install --quiet --no-deps --ignore-requires-python --target "$site" \
  agentlightning==1.0.2 "httpx-retries>=0.4.0"
echo "agentlightning 1.0.2 installed: $site"
