"""``CpuDiffusionModelRunner``: vLLM-Omni's diffusion model runner with the request guard of the CPU platform.

vLLM-Omni asks the platform for its model runner class
(``OmniPlatform.get_diffusion_model_runner_cls``); ``CpuOmniPlatform`` names this one. It is
upstream's ``DiffusionModelRunner`` with two additions in request mode (one request per forward,
vLLM-Omni's default) and request-batch mode, both from :mod:`.request_guard`:

* a request whose decoded frames alone exceed the memory the platform reports is answered with a
  client error (HTTP 400, error type ``RequestTooLarge``) that names its size and the limit, before
  anything is allocated; the next request runs as usual;
* an exception without a message is re-raised as a ``RuntimeError`` naming its type and where it
  was raised, so the failed request carries a reason.

Step mode (``step_execution``) is not guarded. A runner chosen by the engine backend or by
``diffusion_model_runner_cls`` replaces this one, and with it the guard.
"""

from __future__ import annotations

import dataclasses
import logging
from http import HTTPStatus
from typing import Any

from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
from vllm_omni.diffusion.worker.utils import BatchRunnerOutput, RunnerOutput
from vllm_omni.errors import OmniClientError

from .request_guard import failure_reason, memory_limit, oversize_reason, request_size

logger = logging.getLogger(__name__)

REQUEST_TOO_LARGE = "RequestTooLarge"
"""The error type of a refused request (``error.type`` in the client's answer)."""


def refusal(req: Any) -> DiffusionOutput | None:
    """The client-error output for a request too large for this process, or None when it may run."""
    size = request_size(req.prompt, req.sampling_params)
    if size is None:
        return None
    reason = oversize_reason(req.request_id, size, memory_limit())
    if reason is None:
        return None
    logger.warning("%s", reason)
    return DiffusionOutput.from_exception(
        OmniClientError(reason, status_code=HTTPStatus.BAD_REQUEST.value, error_type=REQUEST_TOO_LARGE)
    )


class CpuDiffusionModelRunner(DiffusionModelRunner):
    """``DiffusionModelRunner`` that refuses requests too large for the host and names every failure."""

    def execute_model(self, req: Any, *args: Any, **kwargs: Any) -> DiffusionOutput:
        refused = refusal(req)
        if refused is not None:
            return refused
        try:
            return super().execute_model(req, *args, **kwargs)
        except Exception as exc:
            if str(exc).strip():
                raise
            raise RuntimeError(failure_reason(exc, req.request_id)) from exc

    def execute_model_batch(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> BatchRunnerOutput:
        """Refused requests get their error; the others run as one batch, as upstream would run them."""
        refused: list[RunnerOutput] = []
        admitted = []
        for new_req in scheduler_output.scheduled_new_reqs:
            output = refusal(new_req.req)
            if output is None:
                admitted.append(new_req)
            else:
                refused.append(RunnerOutput(request_id=new_req.request_id, finished=True, result=output))
        if not refused:
            return self._named_batch(scheduler_output, *args, **kwargs)
        ran = self._named_batch(
            dataclasses.replace(scheduler_output, scheduled_new_reqs=admitted), *args, **kwargs
        )
        return BatchRunnerOutput.from_list(refused + list(ran.runner_outputs))

    def _named_batch(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> BatchRunnerOutput:
        if not scheduler_output.scheduled_new_reqs:
            return BatchRunnerOutput.from_list([])
        try:
            return super().execute_model_batch(scheduler_output, *args, **kwargs)
        except Exception as exc:
            if str(exc).strip():
                raise
            ids = ", ".join(new_req.request_id for new_req in scheduler_output.scheduled_new_reqs)
            raise RuntimeError(failure_reason(exc, ids)) from exc
