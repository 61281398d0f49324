"""Prompt accuracy in the demo: a fixed set of task prompts and unseen seeds that every mode's engine
also generates, read back by the detector (:mod:`vllm_omni_mxfp4_tiny.detect`).

The set is the same for every mode of a run: :data:`SEEN` prompts the trained tiny Wan2.2 was
trained on and :data:`HELD_OUT` prompts with colour x shape pairs it never saw
(:data:`~vllm_omni_mxfp4_tiny.task.HELD_OUT_PAIRS`), each with the first ``seed_count`` seeds from
:data:`~vllm_omni_mxfp4_tiny.task.TRAINING_SEEDS` up (so no video of the set was a training example).
One seed by default (:data:`DEFAULT_SEEDS`): a quantized engine on two CPU cores takes about 2 s a
video, and the demo runs ten; docs/quality.md's numbers use three.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_omni_mxfp4_tiny.detect import prompt_accuracy
from vllm_omni_mxfp4_tiny.task import TRAINING_SEEDS, VideoPrompt, sample_prompts, video_prompts

SEEN = 8
HELD_OUT = 4
#: sample_prompts seeds of the two groups, picked once so that the seen prompts hold each colour and
#: each direction twice, every shape, each speed and background four times, and the held-out ones
#: every direction, both speeds and both backgrounds.
SEEN_SAMPLE, HELD_OUT_SAMPLE = 199, 4
DEFAULT_SEEDS = 1


def requests(seed_count: int = DEFAULT_SEEDS) -> list[tuple[VideoPrompt, int, bool]]:
    """Every (prompt, seed, held out) of the set with ``seed_count`` seeds, seen prompts first."""
    if seed_count < 1:
        raise ValueError(f"prompt accuracy: seed_count must be at least 1, got {seed_count}")
    seeds = [TRAINING_SEEDS + i for i in range(seed_count)]
    groups = (
        (sample_prompts(video_prompts(held_out=False), SEEN, SEEN_SAMPLE), False),
        (sample_prompts(video_prompts(held_out=True), HELD_OUT, HELD_OUT_SAMPLE), True),
    )
    return [(prompt, seed, held) for prompts, held in groups for prompt in prompts for seed in seeds]


def job_requests(seed_count: int = DEFAULT_SEEDS) -> list[tuple[str, int]]:
    """The set as an engine job's ``evaluation`` requests."""
    return [(prompt.text, seed) for prompt, seed, _ in requests(seed_count)]


def score(videos: np.ndarray, seed_count: int = DEFAULT_SEEDS) -> dict[str, Any]:
    """Prompt accuracy of one mode's ``videos`` (one per :func:`requests` entry, in order): for the
    seen and the held-out prompts, the share with every attribute right and the share per attribute."""
    wanted = requests(seed_count)
    if len(videos) != len(wanted):
        raise ValueError(
            f"prompt accuracy: expected {len(wanted)} videos, one per request, got {len(videos)}"
        )
    record: dict[str, Any] = {}
    for key, held in (("seen", False), ("held_out", True)):
        pairs = [(prompt, video) for (prompt, _, h), video in zip(wanted, videos) if h == held]
        accuracy = prompt_accuracy(pairs)
        record[key] = {
            "videos": accuracy.outputs,
            "accuracy": accuracy.value,
            "per_attribute": accuracy.per_attribute,
        }
    return record
