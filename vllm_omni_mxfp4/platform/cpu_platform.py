"""Public import path of :class:`CpuOmniPlatform`, safe to import before or after ``vllm_omni``.

Importing ``vllm_omni`` resolves vLLM-Omni's current platform (its package init reaches
``current_omni_platform``), which calls :func:`vllm_omni_mxfp4.platform.activate` and imports the
class it names. Were the class defined in the first module a program imports, that import would
be re-entered half-initialised and fail. So this module imports ``vllm_omni`` first and takes the
class from :mod:`vllm_omni_mxfp4.platform._cpu_platform`, the module the entry point names.
"""

from __future__ import annotations

import vllm_omni  # noqa: F401  (must precede the class import; see the module docstring)

from vllm_omni_mxfp4.platform._cpu_platform import CPU_SDPA_BACKEND, CpuOmniPlatform

__all__ = ["CPU_SDPA_BACKEND", "CpuOmniPlatform"]
