"""What the trained Wan2.2's evaluation gains from compact text, against the full 512 text rows in the
same run.

    python bench/trained_eval.py [--prompts 16] [--steps 10] [--repeats 3]

Loads the shipped tiny Wan2.2 (``vllm_omni_mxfp4_tiny.trained_wan.SHIPPED``) in FP32, as the training
command's evaluation does, and times ``trained_wan.generate`` on one batch of seen task prompts twice
per repeat: the pipeline encoding the prompts itself (512 padded rows, the baseline) and on compact
text (``compact=True``, what ``evaluate`` runs). It prints the median seconds of each, their ratio,
and the largest pixel difference between the two batches of videos (they should be equal up to float
rounding).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from tqdm import tqdm


def main() -> None:
    from diffusers import WanPipeline

    from vllm_omni_mxfp4_tiny import trained_wan
    from vllm_omni_mxfp4_tiny.task import TRAINING_SEEDS, video_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--prompts", type=int, default=16, help="Prompts in the batch (default 16, as evaluate)."
    )
    parser.add_argument("--steps", type=int, default=trained_wan.EVAL_STEPS)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.set_num_threads(2)
    pipeline = WanPipeline.from_pretrained(trained_wan.SHIPPED, dtype=torch.float32)
    texts = [p.text for p in video_prompts(held_out=False)[: args.prompts]]
    settings = (TRAINING_SEEDS, args.steps, trained_wan.EVAL_GUIDANCE, trained_wan.EVAL_GUIDANCE_2)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    videos: dict[bool, np.ndarray] = {}
    for _ in tqdm(range(args.repeats), desc="repeats"):
        for compact in (False, True):
            start = time.perf_counter()
            videos[compact] = trained_wan.generate(pipeline, texts, *settings, compact=compact)
            seconds[compact].append(time.perf_counter() - start)
    full, compact = (statistics.median(seconds[c]) for c in (False, True))
    print(f"{len(texts)} videos, {args.steps} steps, median of {args.repeats}:")
    print(f"  512 text rows (baseline): {full:.2f} s")
    print(f"  compact text:             {compact:.2f} s  ({compact / full:.2f}x the baseline)")
    print(f"  largest pixel difference: {float(np.abs(videos[True] - videos[False]).max()):.2e}")


if __name__ == "__main__":
    main()
