"""The CPU platform's start-up warm-up: a small request instead of upstream's 512x512 one.

Upstream: ``vllm_omni.diffusion.diffusion_engine.DiffusionEngine._dummy_run``. Every diffusion
engine runs one request when it starts (``run_startup_warmup``), built by
``DiffusionEngine._make_dummy_request(height=512, width=512, num_inference_steps=2, ...)``. On an
accelerator that run compiles and autotunes kernels and settles the memory pools at a realistic
size. The CPU platform has neither: vLLM-Omni skips ``torch.compile`` there and memory comes from
the process heap. The run then only checks that the pipeline works end to end, yet at 512x512 it
costs most of an engine's start: 6.2 of 8.6 s for the trained tiny Wan2.2 with ``mxfp4`` on two
cores (measured with 64: 2.5 s).

:func:`install_cpu_warmup_fixup` caps the warm-up request's height and width at
``VLLM_OMNI_MXFP4_CPU_WARMUP_SIZE`` (default 64, read through :mod:`vllm_omni_mxfp4.envs`; ``0``
keeps upstream's size). Everything else about the request is upstream's: it still runs the text
encoders, every transformer and the VAE, so a model that cannot run still fails when the engine
starts. It is installed only in processes where the CPU platform is active
(:func:`vllm_omni_mxfp4.platform.activation.install_fixups`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import envs
from ..patching import wrap_logged

HOOK = "cpu_warmup_size"


def capped_size(height: int, width: int, cap: int) -> tuple[int, int]:
    """``(height, width)`` of the warm-up request under ``cap`` (``0``: unchanged)."""
    if cap <= 0:
        return height, width
    return min(height, cap), min(width, cap)


def install_cpu_warmup_fixup() -> bool:
    """Wrap ``DiffusionEngine._make_dummy_request`` so that the start-up request is at most
    ``VLLM_OMNI_MXFP4_CPU_WARMUP_SIZE`` a side; idempotent. Returns True when this call installed it.

    The variable is read on every warm-up, so a value set after the fix-up was installed counts."""
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine

    what = "CPU platform: the start-up warm-up request capped at VLLM_OMNI_MXFP4_CPU_WARMUP_SIZE (module doc)"
    return wrap_logged(DiffusionEngine, "_make_dummy_request", _capped, HOOK, what)


def _capped(upstream: Callable[..., Any]) -> Callable[..., Any]:
    def _make_dummy_request(self: Any, *, height: int, width: int, **kwargs: Any) -> Any:
        """Upstream's start-up request, at most ``VLLM_OMNI_MXFP4_CPU_WARMUP_SIZE`` a side
        (:mod:`vllm_omni_mxfp4.platform.warmup`)."""
        height, width = capped_size(height, width, envs.cpu_warmup_size())
        return upstream(self, height=height, width=width, **kwargs)

    return _make_dummy_request
