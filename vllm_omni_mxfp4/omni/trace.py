"""Optional per-call trace of which precision each quantized Linear ran at, for validation.

Set ``VLLM_OMNI_MXFP4_TRACE_FILE=/path/trace.jsonl`` before starting the engine: every process
(engine, stage processes, workers) appends one JSON line per quantized Linear call::

    {"pid": 123, "layer": 140..., "method": "mxfp4", "prefix": "blocks.0.attn1.to_qkv",
     "step": 3, "precision": "w4a8", "backend": "emulated"}

``step`` is the published denoising step (``null`` outside a denoising loop). Use it to check that
a W4A8 step list switches exactly where intended, or which layers of which expert are quantized.
Unset (the default), the trace costs one ``None`` check per call.
"""

from __future__ import annotations

import json
import os
import threading

from ..steps import current_denoise_step

TRACE_ENV = "VLLM_OMNI_MXFP4_TRACE_FILE"


class _Trace:
    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()

    def record(self, layer: object, method: str, prefix: str, a8: bool, backend: str) -> None:
        line = json.dumps(
            {
                "pid": os.getpid(),
                "layer": id(layer),
                "method": method,
                "prefix": prefix,
                "step": current_denoise_step(),
                "precision": "w4a8" if a8 else "w4a4",
                "backend": backend,
            }
        )
        with self.lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


TRACE: _Trace | None = _Trace(os.environ[TRACE_ENV]) if os.environ.get(TRACE_ENV) else None
