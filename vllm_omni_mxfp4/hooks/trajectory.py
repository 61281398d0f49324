"""Each denoising step's latents, saved for ``vllm-omni-mxfp4 compare``.

vLLM-Omni's pipelines step their scheduler through ``scheduler_step_maybe_with_cfg`` (its
``CFGParallelMixin``: Wan2.2, FLUX.1, FLUX.2, SD3, HunyuanVideo-1.5, ...; the pipeline-parallel mixin
has its own). With ``VLLM_OMNI_MXFP4_TRAJECTORY_DIR`` set, :func:`install` wraps both so that every step
saves the latents it returns, as float32, to ``<dir>/<pid>-<n>.npy`` with ``n`` counting the steps of
the process (zero-padded, so the names sort in step order). Only rank 0 of the world group writes:
CFG-parallel and sequence-parallel ranks step the same latents. Unset, the wrapper only reads the
variable and calls through.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import envs
from ..patching import wrap_logged

logger = logging.getLogger(__name__)

HOOK = "trajectory"
_STEPS = itertools.count()


def _first_rank() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def save_step(directory: str, latents: Any) -> Path | None:
    """Save one step's latents (a tensor, or the first of a tuple) under ``directory``; the path."""
    tensor = latents[0] if isinstance(latents, tuple) else latents
    if not isinstance(tensor, torch.Tensor) or not _first_rank():
        return None
    path = Path(directory) / f"{os.getpid()}-{next(_STEPS):06d}.npy"
    np.save(path, tensor.detach().to("cpu", torch.float32).numpy())
    return path


_depth = threading.local()


def _recording(original: Callable) -> Callable:
    def scheduler_step_maybe_with_cfg(self, *args: Any, **kwargs: Any) -> Any:
        # The pipeline-parallel mixin's step calls the CFG mixin's: only the outermost call saves.
        depth = getattr(_depth, "value", 0)
        _depth.value = depth + 1
        try:
            latents = original(self, *args, **kwargs)
        finally:
            _depth.value = depth
        directory = envs.trajectory_dir() if depth == 0 else None
        if directory:
            save_step(directory, latents)
        return latents

    return scheduler_step_maybe_with_cfg


def install() -> None:
    """Wrap vLLM-Omni's scheduler steps (idempotent); they save latents only while the variable is set."""
    from vllm_omni.diffusion.distributed.cfg_parallel import CFGParallelMixin

    owners = [CFGParallelMixin]
    try:
        from vllm_omni.diffusion.distributed.pipeline_parallel import PipelineParallelMixin

        owners.append(PipelineParallelMixin)
    except ImportError:  # not in every vLLM-Omni release
        pass
    for owner in owners:
        wrap_logged(owner, "scheduler_step_maybe_with_cfg", _recording, HOOK, "denoising steps recordable")
