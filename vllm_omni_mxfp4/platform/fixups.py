"""The worker fix-up the CPU platform needs in vLLM-Omni 0.30: worker output packing for TP>1.

Upstream function: ``vllm_omni.diffusion.worker.diffusion_worker.WorkerProc._async_output_loop``.
With more than one diffusion worker (tensor parallelism, multiprocess executor) each worker
process runs this loop in a background thread to copy outputs to host shared memory. It assumes
an accelerator twice:

1. ``torch.device(torch.accelerator.current_accelerator().type, ...)``: ``current_accelerator()``
   is ``None`` without an accelerator, so the thread dies with ``AttributeError`` before its first
   item and the request never completes;
2. ``pack_diffusion_output_shm(output, d2h_stream=...)``: with a stream,
   ``vllm_omni.diffusion.ipc._tensor_to_shm`` calls ``torch.accelerator.current_stream()``, which
   raises ``RuntimeError: Cannot access accelerator device when none is available``.

Neither the stream nor the loop is reachable through a platform hook, and ``WorkerProc`` is
constructed by name inside ``WorkerProc.worker_main``, so the narrowest override is this one
method. :func:`cpu_async_output_loop` keeps the loop's protocol (one ``OUTPUT_READY`` reply per
queued item, ``error`` set when packing fails, the pending counter decremented and waiters woken)
and packs synchronously, which on CPU is the same copy without a stream. It is installed only in
processes where the CPU platform is active (:func:`vllm_omni_mxfp4.platform.install_fixups`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..patching import original_of, wrap_logged

logger = logging.getLogger(__name__)

HOOK = "cpu_worker_output"


def cpu_async_output_loop(self: Any) -> None:
    """CPU version of ``WorkerProc._async_output_loop``: pack queued outputs into shared memory.

    ``self`` is a ``WorkerProc``. Items are ``(output, async_output_id, device_event)`` tuples from
    ``WorkerProc._return_result``; ``None`` stops the loop. The device event is always ``None`` on
    CPU (``record_device_event`` is not implemented), so there is nothing to wait for.
    """
    from vllm_omni.diffusion.data import AsyncDiffusionOutput, AsyncOutputKind
    from vllm_omni.diffusion.ipc import pack_diffusion_output_shm

    while True:
        item = self._async_output_queue.get()
        if item is None:
            return
        output, async_output_id, _device_event = item
        try:
            try:
                pack_diffusion_output_shm(output)
                reply = AsyncDiffusionOutput(
                    kind=AsyncOutputKind.OUTPUT_READY, async_output_id=async_output_id, output=output
                )
            except Exception as exc:
                logger.exception("Packing diffusion output %r into shared memory failed", async_output_id)
                reply = AsyncDiffusionOutput(
                    kind=AsyncOutputKind.OUTPUT_READY,
                    async_output_id=async_output_id,
                    error=f"CPU shared-memory packing failed: {exc}",
                )
            self._enqueue_result(reply)
        finally:
            with self._async_output_done:
                self._async_output_pending = max(0, self._async_output_pending - 1)
                self._async_output_done.notify_all()


def upstream_async_output_loop() -> Callable[[Any], None]:
    """The installed vLLM-Omni's own ``WorkerProc._async_output_loop``, whether or not overridden."""
    from vllm_omni.diffusion.worker.diffusion_worker import WorkerProc

    return original_of(WorkerProc.__dict__["_async_output_loop"])


def install_worker_output_fixup() -> bool:
    """Override ``WorkerProc._async_output_loop`` with :func:`cpu_async_output_loop`; idempotent.

    Returns True when this call installed it, False when it was already in place.
    """
    from vllm_omni.diffusion.worker.diffusion_worker import WorkerProc

    what = "CPU platform: WorkerProc._async_output_loop overridden (module doc)"
    return wrap_logged(WorkerProc, "_async_output_loop", _replaced, HOOK, what)


def _replaced(upstream: Callable[[Any], None]) -> Callable[[Any], None]:
    def _async_output_loop(self: Any) -> None:
        cpu_async_output_loop(self)

    _async_output_loop.__doc__ = cpu_async_output_loop.__doc__
    return _async_output_loop
