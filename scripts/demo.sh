#!/usr/bin/env bash
# The main job: builds the environment on first use, then runs the demo (python -m vllm_omni_mxfp4_demo,
# the package of examples/demo) from the current directory: relative paths and the default output
# folder (outputs/demo) are resolved there. Extra arguments go to the demo (see --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$("$root/scripts/env.sh")"
exec "$venv/bin/python" -m vllm_omni_mxfp4_demo "$@"
