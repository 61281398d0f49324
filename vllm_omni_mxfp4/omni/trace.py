"""Optional per-call trace of which precision each quantized Linear ran at, for validation.

Set ``VLLM_OMNI_MXFP4_TRACE_FILE=/path/trace.jsonl`` before starting the engine: every process
(engine, stage processes, workers) appends one JSON line per quantized Linear call::

    {"pid": 123, "layer": 140..., "method": "mxfp4", "prefix": "blocks.0.attn1.to_qkv",
     "step": 3, "precision": "w4a8", "backend": "emulated"}

``step`` is the published denoising step (``null`` outside a denoising loop). Use it to check that
a W4A8 step list switches exactly where intended, or which layers of which expert are quantized.
The variable is read at each call (:func:`vllm_omni_mxfp4.envs.trace_file`), so it takes effect
whenever it is set; unset (the default), a call costs one environment lookup.
"""

from __future__ import annotations

import json
import os
import threading

from .. import envs
from ..config import Precision
from ..steps import current_denoise_step

_LOCK = threading.Lock()


def record(layer: object, method: str, prefix: str, precision: Precision, backend: str) -> None:
    """Append one line for this call to the trace file, if tracing is on."""
    path = envs.trace_file()
    if path is None:
        return
    line = json.dumps(
        {
            "pid": os.getpid(),
            "layer": id(layer),
            "method": method,
            "prefix": prefix,
            "step": current_denoise_step(),
            "precision": precision.value,
            "backend": backend,
        }
    )
    with _LOCK, open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
