"""The denoising-step provider for W4A8 step fallback.

A layer with step fallback needs the index of the current denoising-loop iteration (zero-based,
per request, shared by both Wan experts and both CFG branches). Two sources publish it:

- :func:`denoise_step`, our context manager, for code that runs outside vLLM-Omni (tests, benches,
  a hand-written loop). It takes precedence.
- vLLM-Omni's diffusion forward context (``ForwardContext.denoise_step_idx``), which pipelines set
  through ``record_denoise_step`` at the top of every loop iteration.

Pure Python: this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_FORWARD_CONTEXT_MODULE = "vllm_omni.diffusion.forward_context"

_published_step: ContextVar[int | None] = ContextVar("vllm_omni_mxfp4_denoise_step", default=None)


@contextmanager
def denoise_step(step: int) -> Iterator[None]:
    """Publish ``step`` as the current denoising step for the duration of the ``with`` block.

    Nested blocks restore the outer step on exit. The value is per thread and per asyncio task.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"denoise_step() needs a non-negative integer denoise step index, got {step!r}.")
    token = _published_step.set(step)
    try:
        yield
    finally:
        _published_step.reset(token)


def current_denoise_step() -> int | None:
    """The current denoising step: ours if published, else vLLM-Omni's, else ``None``.

    vLLM-Omni's forward context lives in ``vllm_omni.diffusion.forward_context``; a context can be
    active only once that module is imported, so it is looked up in ``sys.modules`` instead of being
    imported here. That keeps this call cheap and free of side effects, and makes it work where
    vLLM-Omni is not installed.
    """
    step = _published_step.get()
    if step is not None:
        return step
    forward_context = sys.modules.get(_FORWARD_CONTEXT_MODULE)
    if forward_context is None or not forward_context.is_forward_context_available():
        return None
    return forward_context.get_forward_context().denoise_step_idx
