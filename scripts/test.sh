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
echo "[test] pytest (2 workers; -n 0 runs in this process)"
# Two workers: engine start-up (imports) is mostly single-threaded, so two run side by side on two
# cores. Tests are handed out in groups that share their engines and fixtures, longest groups first
# (tests/support/scheduling.py); --no-loadscope-reorder keeps that order.
exec "$venv/bin/python" -m pytest -n 2 --dist loadgroup --no-loadscope-reorder "$@"
