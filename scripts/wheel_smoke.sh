#!/usr/bin/env bash
# The product as a user installs it. Builds agl's sdist and wheel and checks their metadata
# (twine), installs the wheel (not editable) into a fresh venv pinned to the project venv's versions,
# and then, from a scratch directory outside the source tree: `agl --version`, `agl plugins`, 3 steps
# of the corridor example, and the contract tests of a third-party aggregator package
# (tests/wheel_smoke/agl_one_row_per_call) that subclasses agl_core.testing.contracts.AggregatorContract.
#
# Usage: bash scripts/wheel_smoke.sh [PROJECT_PYTHON]
#   PROJECT_PYTHON: a python with agl's test extra (build, twine); default .venv/bin/python.
#   AGL_SMOKE_KEEP=1 keeps the scratch directory (dist/, venv, run) and prints its path.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${1:-$root/.venv/bin/python}"
work="$(mktemp -d "${TMPDIR:-/tmp}/agl-wheel-smoke.XXXXXX")"
if [ "${AGL_SMOKE_KEEP:-0}" = 1 ]; then
  echo "wheel smoke: scratch directory $work"
else
  trap 'rm -rf "$work"' EXIT
fi
step() { echo "wheel smoke [${SECONDS} s]: $*"; }
fail() { echo "wheel smoke: FAILED: $*" >&2; exit 1; }

step "build sdist and wheel"
"$python" -m build --outdir "$work/dist" "$root" > "$work/build.log" 2>&1 || { cat "$work/build.log"; fail "python -m build"; }
"$python" -m twine check --strict "$work"/dist/*
ls -l "$work"/dist
wheel="$(ls "$work"/dist/*.whl)"

step "install the wheel into a fresh venv, pinned to the project venv's versions (pip resolves straight to them)"
"$python" -m pip freeze --exclude-editable | grep -v " @ " > "$work/constraints.txt"
"$python" -m venv "$work/venv"
venv="$work/venv/bin"
# --no-compile: bytecode is written on first import; compiling every file of torch up front is slow.
"$venv/pip" install -q --no-compile -c "$work/constraints.txt" "$wheel[test]"
cp -r "$root/tests/wheel_smoke/agl_one_row_per_call" "$work/"  # built out of the source tree
"$venv/pip" install -q --no-compile -c "$work/constraints.txt" "$work/agl_one_row_per_call"

cd "$work"  # nothing of the source tree is importable from here
installed="$("$venv/python" -c 'import agl_core; print(agl_core.__file__)')"
case "$installed" in "$work/venv/"*) ;; *) fail "agl_core imported from $installed, not from the installed wheel" ;; esac

step "agl --version"
version="$("$venv/agl" --version)"
expected="agl $("$venv/python" -c 'import importlib.metadata as m; print(m.version("agl-backend-verl"))')"
[ "$version" = "$expected" ] || fail "agl --version printed '$version', expected '$expected'"
echo "$version"

step "agl plugins"
"$venv/agl" plugins > plugins.txt
grep -q "^one_row_per_call  \[entry point" plugins.txt || { cat plugins.txt; fail "the third-party aggregator is not listed"; }
grep -q "aggregators: .*trajectory" plugins.txt || { cat plugins.txt; fail "the built-in aggregators are not listed"; }

step "3 steps of the corridor example"
mkdir -p examples
cp -r "$root/examples/corridor" "$root/examples/agent_http.py" examples/  # the agent and the HTTP helpers it imports
"$venv/python" examples/corridor/build_policy.py
"$venv/agl" train examples/corridor/config.yaml trainer.total_training_steps=3 "trainer.default_local_dir=$work/run"
"$venv/python" - "$work/run/metrics.jsonl" <<'PY'
import json, math, sys
steps = {m["step"]: m for m in map(json.loads, open(sys.argv[1]))}
assert {1, 2, 3} <= set(steps), f"metrics.jsonl has steps {sorted(steps)}, expected 1..3"
for step in (1, 2, 3):
    assert math.isfinite(steps[step]["training/reward"]), f"step {step}: reward {steps[step]['training/reward']}"
print(f"steps {sorted(steps)}; training reward {[round(steps[s]['training/reward'], 3) for s in (1, 2, 3)]}")
PY

step "a third-party aggregator's contract tests"
"$venv/python" -m pytest -q -p no:cacheprovider agl_one_row_per_call/tests
step "passed"
