#!/usr/bin/env bash
# The whole test suite: builds the environment on first use, lints, then runs pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/formats -x).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$("$root/scripts/env.sh")"
cd "$root"
echo "[test] ruff check + format check"
"$venv/bin/ruff" check vllm_omni_mxfp4 tools examples bench tests scripts
"$venv/bin/ruff" format --check vllm_omni_mxfp4 tools examples bench tests scripts
echo "[test] pytest"
exec "$venv/bin/python" -m pytest "$@"
