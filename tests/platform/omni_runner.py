"""Run vLLM-Omni's ``Omni`` on a model once and save the frames of several requests (a test helper).

Run in a subprocess by the engine tests so that every engine process can be reaped as a group::

    python omni_runner.py --model DIR --out DIR [--tp N] [--quantization NAME] --seeds 0 0 1

Writes ``frames_<i>.npy`` (request ``i``'s ``images[0]``) and ``meta.json`` (output types,
dtypes, shapes, the platform class the engine ran on).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

PROMPT = "a cat walking on the grass"
NEGATIVE_PROMPT = "blurry low quality"
HEIGHT = WIDTH = 16
NUM_FRAMES = 9
STEPS = 2
GUIDANCE = 5.0
BOUNDARY_RATIO = 0.875


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    args = parser.parse_args()

    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    engine_kwargs = {"dtype": "bfloat16", "boundary_ratio": BOUNDARY_RATIO}
    if args.tp > 1:
        engine_kwargs["tensor_parallel_size"] = args.tp
    if args.quantization:
        engine_kwargs["quantization"] = args.quantization

    started = time.monotonic()
    omni = Omni(model=args.model, **engine_kwargs)
    constructed = time.monotonic()
    meta: dict = {"outputs": [], "construct_s": constructed - started}
    try:
        for index, seed in enumerate(args.seeds):
            params = OmniDiffusionSamplingParams(
                height=HEIGHT,
                width=WIDTH,
                num_frames=NUM_FRAMES,
                num_inference_steps=STEPS,
                guidance_scale=GUIDANCE,
                seed=seed,
            )
            outputs = omni.generate({"prompt": PROMPT, "negative_prompt": NEGATIVE_PROMPT}, params)
            output = outputs[0]
            frames = output.images[0]
            np.save(args.out / f"frames_{index}.npy", np.asarray(frames))
            meta["outputs"].append(
                {
                    "seed": seed,
                    "count": len(outputs),
                    "final_output_type": output.final_output_type,
                    "python_type": type(frames).__name__,
                    "dtype": str(frames.dtype),
                    "shape": list(frames.shape),
                }
            )
        meta["generate_s"] = time.monotonic() - constructed
        from vllm_omni.platforms import current_omni_platform

        platform = type(current_omni_platform)
        meta["platform"] = f"{platform.__module__}.{platform.__qualname__}"
    finally:
        omni.shutdown()
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"omni_runner: {len(args.seeds)} request(s) in {meta['generate_s']:.1f}s", flush=True)


if __name__ == "__main__":
    main()
