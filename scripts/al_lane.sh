#!/usr/bin/env bash
# CI's Python 3.12 lane: agl installed into one venv beside agentlightning 1.0.2, as an Agent Lightning
# v1.0 user has it, at the other end of pyproject.toml's ranges from the main lane
# (constraints/py312-agentlightning.txt: torch 2.11 is the registry's CUDA build, run on CPU). It runs
# the tests of what such a user meets: hook files (with Agent Lightning's own models), configs, v1.0's
# example configs, parquet datasets, the migration guide, the pipeline and the device check.
# Usage: bash scripts/py312_lane.sh   (PYTHON312 overrides pyenv's 3.12.1 interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
python312=${PYTHON312:-$(pyenv root)/versions/3.12.1/bin/python}
venv=.venv-py312
t=$(date +%s)
rm -rf "$venv"
"$python312" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q -c constraints/py312-agentlightning.txt agentlightning -e '.[test]'
echo "py312 lane install: $(( $(date +%s) - t )) s"
"$venv/bin/python" -c "import agentlightning, torch, transformers, tensordict, packaging, verl; print('py312 lane:', 'agentlightning', agentlightning.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'tensordict', tensordict.__version__, 'packaging', packaging.__version__, 'verl', verl.__version__)"
t=$(date +%s)
RAY_AUTH_MODE=disabled "$venv/bin/python" -m pytest -q \
    tests/hooks/test_hook_files.py tests/plugins/test_calls.py tests/config/test_schema.py tests/config/test_field_configs.py \
    tests/verl/test_config.py tests/verl/test_al_v1_configs.py tests/test_parquet_datasets.py \
    tests/test_migration_guide.py tests/stages/test_pipeline.py tests/scripts/test_device_check.py
echo "py312 lane tests: $(( $(date +%s) - t )) s"
