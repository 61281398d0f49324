"""Prompt accuracy in the demo: a fixed set of task prompts and unseen seeds that every mode's engine
also generates, read back by the detector (:mod:`vllm_omni_mxfp4_tiny.detect`).

A trained tiny model has one set (:class:`AccuracySet`): :data:`VIDEO` for the Wan2.2 text-to-video
model, :data:`IMAGE` for the FLUX.1-dev text-to-image one. Each holds prompts the model was trained
on and prompts with colour x shape pairs it never saw
(:data:`~vllm_omni_mxfp4_tiny.task.HELD_OUT_PAIRS`), each with the first ``seed_count`` seeds from
:data:`~vllm_omni_mxfp4_tiny.task.TRAINING_SEEDS` up (so no output of the set was a training
example). One seed by default (:data:`DEFAULT_SEEDS`): a quantized engine on two CPU cores takes
about 1 s a video in a batch, and the demo runs a dozen modes; docs/quality.md's numbers use three.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_omni_mxfp4_tiny.detect import prompt_accuracy
from vllm_omni_mxfp4_tiny.task import TRAINING_SEEDS, image_prompts, sample_prompts, video_prompts

DEFAULT_SEEDS = 1


@dataclass(frozen=True)
class AccuracySet:
    """``seen`` prompts the model was trained on and ``held_out`` ones it never saw, drawn once from
    ``prompts(held_out)`` with the ``sample_prompts`` seeds ``seen_sample`` and ``held_out_sample``
    (picked so that the groups cover the vocabulary; the tests check what each covers)."""

    kind: str  # what one output is: "video" or "image"
    prompts: Callable[[bool], list[Any]]
    seen: int
    held_out: int
    seen_sample: int
    held_out_sample: int

    def requests(self, seed_count: int = DEFAULT_SEEDS) -> list[tuple[Any, int, bool]]:
        """Every (prompt, seed, held out) of the set with ``seed_count`` seeds, seen prompts first."""
        if seed_count < 1:
            raise ValueError(f"prompt accuracy: seed_count must be at least 1, got {seed_count}")
        seeds = [TRAINING_SEEDS + i for i in range(seed_count)]
        groups = (
            (sample_prompts(self.prompts(False), self.seen, self.seen_sample), False),
            (sample_prompts(self.prompts(True), self.held_out, self.held_out_sample), True),
        )
        return [(prompt, seed, held) for prompts, held in groups for prompt in prompts for seed in seeds]

    def job_requests(self, seed_count: int = DEFAULT_SEEDS) -> list[tuple[str, int]]:
        """The set as an engine job's ``evaluation`` requests."""
        return [(prompt.text, seed) for prompt, seed, _ in self.requests(seed_count)]

    def score(self, outputs: np.ndarray, seed_count: int = DEFAULT_SEEDS) -> dict[str, Any]:
        """Prompt accuracy of one mode's ``outputs`` (one video or image per :meth:`requests` entry,
        in order): for the seen and the held-out prompts, how many outputs, the share with every
        attribute right and the share per attribute."""
        wanted = self.requests(seed_count)
        if len(outputs) != len(wanted):
            raise ValueError(
                f"prompt accuracy: expected {len(wanted)} {self.kind}s, one per request, got {len(outputs)}"
            )
        record: dict[str, Any] = {}
        for key, held in (("seen", False), ("held_out", True)):
            pairs = [(prompt, output) for (prompt, _, h), output in zip(wanted, outputs) if h == held]
            accuracy = prompt_accuracy(pairs)
            record[key] = {
                "outputs": accuracy.outputs,
                "accuracy": accuracy.value,
                "per_attribute": accuracy.per_attribute,
            }
        return record


#: The trained tiny Wan2.2's set: the seen prompts hold each colour and each direction twice, every
#: shape, each speed and background four times; the held-out ones every direction, both speeds and
#: both backgrounds.
VIDEO = AccuracySet("video", lambda held: video_prompts(held_out=held), 8, 4, 199, 4)

#: The trained tiny FLUX.1-dev's set: the seen prompts hold every colour and every position at least
#: twice, every shape at least three times and each background five times; the held-out ones each
#: held-out pair and each background twice, at four positions.
IMAGE = AccuracySet("image", lambda held: image_prompts(held_out=held), 10, 4, 3770, 46)
