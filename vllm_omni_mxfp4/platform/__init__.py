"""The CPU platform for vLLM-Omni: ``Omni(...)`` and ``vllm serve --omni`` on a machine without accelerators.

It exists to validate (quantized) diffusion checkpoints through vLLM-Omni's real loading and
serving code; it is not a performance path. User documentation: ``docs/cpu_platform.md``.

One job per module:

* :mod:`.probes`: is an accelerator present (the probe table);
* :mod:`.activation`: whether the platform applies, and the two entry points ``activate`` and
  ``install_fixups`` that ``pyproject.toml`` registers under this package's name;
* :mod:`._cpu_platform`: the ``CpuOmniPlatform`` class vLLM-Omni instantiates;
* :mod:`.attention`: torch SDPA attention dispatched for CPU;
* :mod:`.fixups`: the runtime override of vLLM-Omni that multi-process runs need;
* :mod:`.op_fixups`: two ops CUDA and Ascend provide and vLLM's CPU path lacks (a strided GEMM
  input, a per-token rotary table);
* :mod:`.request_guard`: the memory a request needs at least, the limit, and a failure's reason;
* :mod:`.runner`: vLLM-Omni's model runner with that guard (the platform's runner class);
* :mod:`.job_errors`: the override that gives a failed video job a reason in the API server.

Import the class as ``vllm_omni_mxfp4.platform.CpuOmniPlatform``. That attribute imports
``vllm_omni`` before the class module, because importing ``vllm_omni`` resolves the current
platform, which calls :func:`activate` and imports the class module itself; had the class module
been imported first, vLLM-Omni would find it half-initialised. Importing this package imports
neither torch nor vLLM-Omni.
"""

from __future__ import annotations

from typing import Any

from .activation import PLATFORM_CLASS, Activator, Decision, activate, decide, install_fixups
from .probes import ACCELERATOR_PROBES, detected_accelerators

__all__ = [
    "ACCELERATOR_PROBES",
    "PLATFORM_CLASS",
    "Activator",
    "CpuOmniPlatform",
    "Decision",
    "activate",
    "decide",
    "detected_accelerators",
    "install_fixups",
]


def __getattr__(name: str) -> Any:
    if name == "CpuOmniPlatform":
        import vllm_omni  # noqa: F401  (resolves the platform first; see the module docstring)

        from ._cpu_platform import CpuOmniPlatform

        return CpuOmniPlatform
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
