"""Run ``vllm_omni.Omni`` with a quantization argument and save frames (an e2e test helper).

    python omni_quant_runner.py JOB.json

JOB: {"model": DIR, "out": DIR, "kwargs": {...Omni kwargs...}, "seed": 0, "steps": 3}. Writes
``frames.npy`` and ``meta.json``; run with VLLM_OMNI_MXFP4_TRACE_FILE set to record every
quantized Linear call.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    out = Path(job["out"])
    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    omni = Omni(model=job["model"], dtype="bfloat16", boundary_ratio=0.875, **job["kwargs"])
    try:
        params = OmniDiffusionSamplingParams(
            height=16,
            width=16,
            num_frames=9,
            num_inference_steps=job["steps"],
            guidance_scale=5.0,
            seed=job["seed"],
        )
        outputs = omni.generate({"prompt": "a cat walking on the grass", "negative_prompt": "blurry"}, params)
        frames = np.asarray(outputs[0].images[0])
        np.save(out / "frames.npy", frames)
        (out / "meta.json").write_text(json.dumps({"shape": list(frames.shape), "dtype": str(frames.dtype)}))
    finally:
        omni.shutdown() if hasattr(omni, "shutdown") else None


if __name__ == "__main__":
    main()
