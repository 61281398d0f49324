"""Failed video jobs carry their reason: the CPU platform's override of the API server's error record.

Upstream function: ``vllm_omni.entrypoints.openai.video.generation.helpers._video_error_from_exception``.
``POST /v1/videos`` runs each job in the API server process; when the job raises, vLLM-Omni 0.30
records ``VideoError(code, message=str(exc))``. An exception without a message leaves the job's
``error.message`` empty. The common case on the CPU platform: with more than one worker, the
engine waits ``VLLM_OMNI_ASYNC_OUTPUT_TIMEOUT`` seconds for each output and re-raises the bare
``TimeoutError()`` of ``asyncio.wait_for``. Errors raised inside a worker are already named by the
platform's model runner (:mod:`.runner`); this override covers what fails outside it.

The API server has no hook for the error record, so the narrowest override is this one function:
:func:`install_video_error_fixup` wraps it so that an empty message becomes the exception's type
and where it was raised (:func:`.request_guard.failure_reason`); every other record is upstream's,
unchanged. It is installed with the worker output fix-up (:func:`vllm_omni_mxfp4.platform.install_fixups`),
in processes where the CPU platform is active. ``tests/platform/test_request_limits.py`` fails once
upstream keeps such reasons by itself.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from ..patching import original_of, wrap_logged
from .request_guard import failure_reason

logger = logging.getLogger(__name__)

HOOK = "cpu_job_errors"

HELPERS = "vllm_omni.entrypoints.openai.video.generation.helpers"
"""The upstream module; the API server imports it at start-up, before it loads general plugins."""


def upstream_video_error() -> Callable[[Exception], Any]:
    """The installed vLLM-Omni's own ``_video_error_from_exception``, whether or not overridden."""
    from vllm_omni.entrypoints.openai.video.generation import helpers

    return original_of(helpers._video_error_from_exception)


def install_video_error_fixup() -> bool:
    """Wrap ``helpers._video_error_from_exception`` so a failed job's message is never empty; idempotent.

    Acts only in a process that has already imported the video API (the API server): importing it
    elsewhere would load the server's dependencies (torchaudio) into engine and worker processes.
    Returns True when this call installed it, False when it was already in place or not applicable.
    """
    helpers = sys.modules.get(HELPERS)
    if helpers is None:
        return False
    what = "CPU platform: video job errors always carry a reason (module doc)"
    return wrap_logged(helpers, "_video_error_from_exception", _with_reason, HOOK, what)


def _with_reason(upstream: Callable[[Exception], Any]) -> Callable[[Exception], Any]:
    def _video_error_from_exception(exc: Exception) -> Any:
        error = upstream(exc)
        if str(error.message).strip():
            return error
        return error.model_copy(update={"message": failure_reason(exc)})

    return _video_error_from_exception
