"""One demo mode in its own process: build ``Omni(...)``, generate one video, report what ran.

    python -m vllm_omni_mxfp4.demo.engine_job JOB.json

``JOB.json``: ``{"model": DIR, "out": DIR, "omni_kwargs": {...}, "prompt": str, "negative_prompt": str,
"height": int, "width": int, "num_frames": int, "steps": int, "guidance_scale": float, "seed": int,
"boundary_ratio": float | null, "scale_seed": int | null}``. Writes ``frames.npy`` (float32
``(F, H, W, 3)``), ``frames_scale_seed.npy`` (the same request with ``scale_seed``, when set) and
``result.json`` (load and generation seconds, the platform, and the engine's
:mod:`~vllm_omni_mxfp4.demo.engine_report` per transformer). The demo runs each mode this way so
that every engine starts from a fresh process and its memory is its own.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Run one generation as ``job`` describes; returns the result dict (also written to disk)."""
    import numpy as np
    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    from .engine_report import WORKER_EXTENSION, platform_description, transformer_reports
    from .media import video_frames

    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    kwargs = dict(job.get("omni_kwargs") or {})
    if job.get("boundary_ratio") is not None:
        kwargs["boundary_ratio"] = job["boundary_ratio"]
    start = time.perf_counter()
    omni = Omni(model=job["model"], dtype="bfloat16", worker_extension_cls=WORKER_EXTENSION, **kwargs)
    load_s = time.perf_counter() - start
    try:
        reports = transformer_reports(omni)
        prompt = {"prompt": job["prompt"], "negative_prompt": job["negative_prompt"]}

        def generate(seed: int) -> np.ndarray:
            params = OmniDiffusionSamplingParams(
                height=job["height"],
                width=job["width"],
                num_frames=job["num_frames"],
                num_inference_steps=job["steps"],
                guidance_scale=job["guidance_scale"],
                seed=seed,
            )
            return video_frames(omni.generate(prompt, params))

        start = time.perf_counter()
        frames = generate(job["seed"])
        gen_s = time.perf_counter() - start
        if job.get("scale_seed") is not None:
            np.save(out / "frames_scale_seed.npy", generate(job["scale_seed"]))
    finally:
        omni.shutdown()
    np.save(out / "frames.npy", frames)
    result = {
        "load_s": load_s,
        "gen_s": gen_s,
        "platform": platform_description(),
        "frames_shape": list(frames.shape),
        "transformers": [dataclasses.asdict(r) for r in reports],
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m vllm_omni_mxfp4.demo.engine_job JOB.json", file=sys.stderr)
        return 2
    run_job(json.loads(Path(args[0]).read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
