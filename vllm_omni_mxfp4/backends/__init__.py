"""Backends: where and how MXFP4 Linears run (emulated, Ascend NPU, ROCm AITER).

``get_backend(name)`` returns the backend for a config's ``backend`` key. ``auto`` picks the NPU
when torch_npu imports and an NPU is present, ROCm when AITER imports on a gfx950 GPU, and the
emulated backend otherwise, and logs one line saying which and why.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os

import torch

from .base import MxBackend, MxLayerSpec
from .emulated import EmulatedBackend

logger = logging.getLogger(__name__)

__all__ = ["MxBackend", "MxLayerSpec", "EmulatedBackend", "get_backend", "detect_backend"]


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # already in sys.modules without a spec (a test double): importable
        return True


def _npu_status() -> tuple[bool, str]:
    if not _installed("torch_npu"):
        return False, "torch_npu is not installed"
    try:
        importlib.import_module("torch_npu")
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available() or npu.device_count() == 0:
            return False, "torch_npu imports but no NPU device is available"
    except Exception as exc:  # a broken CANN install must not stop the emulated path
        return False, f"torch_npu is installed but does not import ({exc.__class__.__name__}: {exc})"
    return True, "torch_npu imports and an NPU is present"


def _rocm_status() -> tuple[bool, str]:
    from .rocm import gpu_arch

    arch = gpu_arch()
    if arch is None:
        return False, "no ROCm GPU"
    if "gfx950" not in arch:
        return False, f"the ROCm GPU is {arch}, not gfx950 (MI350X/MI355X)"
    if not _installed("aiter"):
        return False, "ROCm gfx950 GPU present but AITER is not installed"
    return True, f"AITER is installed and the GPU is {arch}"


def detect_backend() -> tuple[str, str]:
    """The backend ``auto`` resolves to here, and why."""
    npu_ok, npu_why = _npu_status()
    if npu_ok:
        return "npu", npu_why
    rocm_ok, rocm_why = _rocm_status()
    if rocm_ok:
        return "rocm", rocm_why
    return "emulated", f"{npu_why}; {rocm_why}"


BACKEND_ENV = "VLLM_OMNI_MXFP4_BACKEND"
"""Overrides what ``backend: auto`` resolves to, in every process (``npu``, ``rocm`` or ``emulated``).

vLLM-Omni rebuilds each expert's config from a serialized checkpoint's ``config.json`` and carries
over only the W4A8 / scale-algorithm / Smooth policies of the runtime config, so an offline
checkpoint always resolves ``backend`` to ``auto``; this variable chooses the backend there too.
"""

BACKEND_NAMES = ("auto", "npu", "rocm", "emulated")


@functools.cache
def get_backend(name: str = "auto") -> MxBackend:
    """The (process-wide) backend instance for a config's ``backend`` value."""
    if name == "auto":
        forced = os.environ.get(BACKEND_ENV, "").strip().lower() or "auto"
        if forced not in BACKEND_NAMES:
            raise ValueError(f"{BACKEND_ENV} must be one of {list(BACKEND_NAMES)}; got {forced!r}")
        if forced != "auto":
            name, why = forced, f"{BACKEND_ENV}={forced}"
        else:
            name, why = detect_backend()
        logger.info("vllm-omni-mxfp4: MXFP4 backend '%s' (%s)", name, why)
    if name == "emulated":
        return EmulatedBackend()
    if name == "npu":
        from .npu import NpuBackend

        return NpuBackend()
    if name == "rocm":
        from .rocm import RocmBackend

        return RocmBackend()
    raise ValueError(f"backend must be one of {list(BACKEND_NAMES)}; got {name!r}")
