"""Is an accelerator present? One probe per accelerator family, collected in one table.

The CPU platform must never take over a machine that has a real device, so ``auto`` activation
asks every probe in :data:`ACCELERATOR_PROBES`. A probe answers ``True`` when it finds a device. It
may raise (a driver library that is installed but cannot load); :func:`detected_accelerators` then
counts that accelerator as absent, as vLLM-Omni does for its own detectors. Torch and vLLM-Omni are
imported inside the probes, so importing this module costs nothing.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Mapping

logger = logging.getLogger(__name__)

Probe = Callable[[], bool]


def torch_cuda_device() -> bool:
    """A CUDA or ROCm GPU visible to torch (``device_count`` uses NVML/amdsmi, no CUDA context)."""
    import torch

    return torch.cuda.device_count() > 0


def torch_npu_device() -> bool:
    """An Ascend NPU: ``torch_npu`` importable and at least one device."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch
    import torch_npu  # noqa: F401  (adds torch.npu)

    return torch.npu.is_available() and torch.npu.device_count() > 0


def torch_xpu_device() -> bool:
    """An Intel XPU visible to torch."""
    import torch

    return hasattr(torch, "xpu") and torch.xpu.is_available() and torch.xpu.device_count() > 0


def vllm_omni_builtin_platform() -> bool:
    """Any of vLLM-Omni's built-in platform detectors (CUDA, ROCm, NPU, XPU, MUSA) fires.

    A detector that raises means "not this platform", as vLLM-Omni itself treats it.
    """
    from vllm_omni.platforms import builtin_omni_platform_plugins

    for name, detect in builtin_omni_platform_plugins.items():
        try:
            if detect() is not None:
                logger.debug("vLLM-Omni built-in platform %r detected", name)
                return True
        except Exception:
            logger.debug("vLLM-Omni built-in platform detector %r failed", name, exc_info=True)
    return False


ACCELERATOR_PROBES: dict[str, Probe] = {
    "cuda/rocm (torch)": torch_cuda_device,
    "npu (torch_npu)": torch_npu_device,
    "xpu (torch)": torch_xpu_device,
    "vllm-omni built-in platform": vllm_omni_builtin_platform,
}
"""The probes ``auto`` activation asks, by the name a log line or a warning shows."""


def detected_accelerators(probes: Mapping[str, Probe] = ACCELERATOR_PROBES) -> list[str]:
    """Names of the ``probes`` that find an accelerator; a probe that raises counts as absent."""
    found = []
    for name, probe in probes.items():
        try:
            present = probe()
        except Exception:
            logger.debug("Accelerator probe %r failed; treating it as absent", name, exc_info=True)
            present = False
        if present:
            found.append(name)
    return found
