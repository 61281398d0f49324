"""Kernels: where and how MXFP4 Linears run, one implementation per (format, backend).

:data:`KERNELS` is the one registry, keyed by (format, backend name of ``spec.BACKENDS``); each
entry lists the kernels of that cell, which differ in whose numerics they compute (``numerics``:
the emulated backend computes the NPU's by default, the ROCm backend's under
``VLLM_OMNI_MXFP4_EMULATED_MIRROR=rocm:<rule>``). A backend without a kernel for a format refuses
it with the reason its other kernels declare (:meth:`MxKernel.can_implement`).

:class:`KernelSelector` resolves a config's ``backend`` key (``auto``: ``VLLM_OMNI_MXFP4_BACKEND``,
else detection: the NPU when torch_npu imports and an NPU is present, ROCm when AITER is installed
on a gfx950 GPU, emulated otherwise; one log line says which and why) and builds each kernel once.
Its lifetime is the quantization config that owns it (one model component): environment options
are read when it first builds a kernel, so the next config built sees changed variables.
"""

from __future__ import annotations

import logging

from .. import envs
from ..spec import BACKENDS, FORMATS
from .base import MxKernel, MxLayerSpec, Prepared, SharedBlocks
from .emulated import EmulatedDual, EmulatedMxfp8, EmulatedSingle
from .emulated_rocm import EmulatedAiterSingle
from .npu import NpuDual, NpuMxfp8, NpuSingle
from .rocm import AiterSingle

logger = logging.getLogger(__name__)

__all__ = [
    "KERNELS",
    "EmulatedAiterSingle",
    "EmulatedDual",
    "EmulatedMxfp8",
    "EmulatedSingle",
    "KernelSelector",
    "MxKernel",
    "MxLayerSpec",
    "NpuDual",
    "NpuMxfp8",
    "NpuSingle",
    "AiterSingle",
    "Prepared",
    "SharedBlocks",
    "detect_backend",
    "kernel_class",
]

KERNELS: dict[tuple[str, str], tuple[type[MxKernel], ...]] = {
    (fmt, backend): tuple(
        cls
        for cls in (
            EmulatedSingle,
            EmulatedDual,
            EmulatedMxfp8,
            EmulatedAiterSingle,
            NpuSingle,
            NpuDual,
            NpuMxfp8,
            AiterSingle,
        )
        if (cls.format, cls.backend) == (fmt, backend)
    )
    for fmt in FORMATS
    for backend in BACKENDS
}
"""(format, backend) -> the kernels of that cell (empty where the backend cannot run the format)."""

DETECTION_ORDER = ("npu", "rocm")
"""Backends ``auto`` tries, in order, before falling back to ``emulated``."""


def detect_backend() -> tuple[str, str]:
    """The backend ``auto`` resolves to here, and why."""
    reasons = []
    for backend in DETECTION_ORDER:
        ok, why = _family(backend, backend)[0].is_supported()
        if ok:
            return backend, why
        reasons.append(why)
    return "emulated", "; ".join(reasons)


def _family(backend: str, numerics: str) -> list[type[MxKernel]]:
    """Every kernel of ``backend`` that computes ``numerics``' numerics, over all formats."""
    return [cls for fmt in FORMATS for cls in KERNELS[fmt, backend] if cls.numerics == numerics]


def kernel_class(fmt: str, backend: str, mirror: str = "npu") -> type[MxKernel]:
    """The kernel of (``fmt``, ``backend``); for ``emulated``, the one computing ``mirror``'s numerics
    (``npu`` or ``rocm:<rule>``). Without one, a kernel of the same backend (to refuse the layer)."""
    numerics = mirror.partition(":")[0] if backend == "emulated" else backend
    family = _family(backend, numerics)
    return next((cls for cls in family if cls.format == fmt), family[0])


_announced: set[tuple[str, str]] = set()


class KernelSelector:
    """One config's kernels: resolves its ``backend`` once and builds each kernel class once."""

    def __init__(self, backend: str = "auto") -> None:
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {['auto', *BACKENDS]}; got {backend!r}")
        self.requested = backend
        self._backend: str | None = None
        self._mirror = "npu"
        self._kernels: dict[type[MxKernel], MxKernel] = {}

    @property
    def backend(self) -> str:
        """The backend name ``requested`` resolves to (``auto``: the override variable, else detection);
        the emulated backend's mirror is read with it."""
        if self._backend is None:
            name = self.requested
            if name == "auto":
                forced = envs.backend()
                name, why = (
                    (forced, f"{envs.BACKEND.name}={forced}") if forced != "auto" else detect_backend()
                )
                if (name, why) not in _announced:  # once per process and choice, as vLLM's info_once
                    _announced.add((name, why))
                    logger.info("vllm-omni-mxfp4: MXFP4 backend '%s' (%s)", name, why)
            self._mirror = envs.emulated_mirror() if name == "emulated" else "npu"
            self._backend = name
        return self._backend

    def kernel_for(self, spec: MxLayerSpec) -> MxKernel:
        """The kernel that runs ``spec``'s layer; ``NotImplementedError`` naming the alternatives if none."""
        cls = kernel_class(spec.fmt, self.backend, self._mirror)
        kernel = self._kernels.get(cls)
        if kernel is None:
            kernel = self._kernels[cls] = cls()
            logger.debug("vllm-omni-mxfp4: %s kernel %s", spec.fmt, kernel.describe())
        kernel.check(spec)
        return kernel
