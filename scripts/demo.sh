#!/usr/bin/env bash
# The main job: builds the environment on first use, then runs the demo
# (python -m vllm_omni_mxfp4.demo). Extra arguments go to the demo (see --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$("$root/scripts/env.sh")"
cd "$root"
exec "$venv/bin/python" -m vllm_omni_mxfp4.demo "$@"
