#!/usr/bin/env bash
# `agl new-plugin` end to end: generate a plugin in a temporary folder, install it (pip install -e)
# into the project venv, run its own tests, then uninstall it so it is not loaded by later runs.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
# absolute, so it still names the venv once the tests run from the generated folder
python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"
work=$(mktemp -d)
cleanup() {
    "$python" -m pip uninstall -q -y agl-template-smoke >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT
"$python" -m agl_core.cli new-plugin agl-template-smoke --dir "$work"
"$python" -m pip install -q -e "$work/agl-template-smoke"
# Into a file first: grep -q stops reading at its match, and agl would write into a closed pipe.
"$python" -m agl_core.cli plugins > "$work/plugins.txt"
grep -q '^agl_template_smoke  \[entry point' "$work/plugins.txt"
(cd "$work/agl-template-smoke" && "$python" -m pytest -q --hypothesis-profile agl-fast)
