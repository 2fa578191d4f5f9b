#!/usr/bin/env bash
# CI's Agent Lightning lanes: agl installed into one venv beside agentlightning 1.0.2, as an Agent
# Lightning v1.0 user has it (Python >= 3.12), at the other end of pyproject.toml's ranges from the
# main lane (constraints/agentlightning.txt: torch 2.11 is the registry's CUDA build, run on CPU).
# It runs the tests of what such a user meets: hook files (with Agent Lightning's own models), plugins,
# configs (v1.0's example configs), parquet datasets, the migration guide, the stages, the built-ins,
# the plugin kit and the device check. verl 0.9 requires Python < 3.13, so on 3.13 agl installs
# without it: the tests that need verl are left out (-m "not verl") and the lane checks that
# backend=verl is refused naming this Python.
# Usage: bash scripts/al_lane.sh 3.12|3.13 [install|test]   (both phases when none is named; AGL_PYTHON
# overrides pyenv's interpreter of that version). CI installs both lanes while its other tests run (the
# installs wait on the registry) and tests them at the end, one after the other (the tests need the CPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: al_lane.sh 3.12|3.13 [install|test]}
phase=${2:-all}
case "$phase" in
  install | test | all) ;;
  *) echo "al_lane.sh: no phase $phase (install, test, or none for both)" >&2; exit 2 ;;
esac
case "$version" in
  3.12) pyenv_version=3.12.1; select=() ;;
  3.13) pyenv_version=3.13.0; select=(-m "not verl") ;;
  *) echo "al_lane.sh: no lane for Python $version (3.12 or 3.13)" >&2; exit 2 ;;
esac
python=${AGL_PYTHON:-$(pyenv root)/versions/$pyenv_version/bin/python}
venv=.venv-py${version/./}
lane="py${version/./} lane"
if [ "$phase" != test ]; then
  t=$(date +%s)
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # --no-compile: Python compiles what a run imports, a fraction of the venv's modules (vLLM's alone
  # holds ~22,000 .py files), instead of pip compiling them all at install.
  "$venv/bin/pip" install -q --no-compile -c constraints/agentlightning.txt agentlightning -e '.[test]'
  echo "$lane install: $(( $(date +%s) - t )) s"
  "$venv/bin/python" - "$lane" <<'PY'
import importlib.metadata, platform, sys
names = ["agentlightning", "torch", "transformers", "tensordict", "packaging", "verl"]
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
print(f"{sys.argv[1]}: Python {platform.python_version()},", ", ".join(f"{n} {version(n)}" for n in names))
PY
fi
[ "$phase" != install ] || exit 0
[ -x "$venv/bin/python" ] || { echo "al_lane.sh: $venv is not installed (run the install phase first)" >&2; exit 2; }
t=$(date +%s)
# tests/test_agent_lightning_102.py checks the installed agentlightning is the constraints' version and
# loads its shipped verl config with every key 1.0.2 added.
expected=$(sed -n 's/^agentlightning==//p' constraints/agentlightning.txt)
# Each property draws 20 examples here (AGL_HYPOTHESIS_PROFILE, tests/conftest.py): the lanes check agl
# in an Agent Lightning user's environment; the main lane draws 100.
AGL_HYPOTHESIS_PROFILE=agl-tests-fast AGL_EXPECT_AGENTLIGHTNING=$expected RAY_AUTH_MODE=disabled "$venv/bin/python" -m pytest -q -p no:cacheprovider -n "$(nproc)" "${select[@]}" \
    tests/hooks tests/plugins tests/config tests/stages tests/builtins tests/testing_kit \
    tests/verl/test_config.py tests/verl/test_al_v1_configs.py tests/verl/test_verl_version.py tests/test_parquet_datasets.py \
    tests/test_migration_guide.py tests/test_agent_lightning_102.py tests/scripts/test_device_check.py
echo "$lane tests: $(( $(date +%s) - t )) s"
