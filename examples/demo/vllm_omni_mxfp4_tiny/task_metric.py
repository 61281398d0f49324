"""The tiny task's detector as a task metric of ``vllm-omni-mxfp4 compare`` (its
``vllm_omni_mxfp4.task_metrics`` entry point).

For a trained tiny pipeline (a directory with ``TRAINING.json``) :func:`task_metric` returns a judge
that reads one output with the detector (:mod:`.detect`) and says, per attribute of the task prompt
it was generated for, whether the output shows it; prompts outside the task are not judged.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from .detect import matches, read
from .task import image_prompts, video_prompts
from .training_command import MANIFEST


def task_metric(model: str) -> Callable[[str, np.ndarray], dict[str, bool] | None] | None:
    """A judge for ``model``'s outputs when it is a trained tiny pipeline, else ``None``."""
    if not (Path(model) / MANIFEST).is_file():
        return None
    known = {prompt.text: prompt for prompt in (*video_prompts(), *image_prompts())}

    def judge(prompt: str, frames: np.ndarray) -> dict[str, bool] | None:
        task_prompt = known.get(prompt)
        return None if task_prompt is None else matches(task_prompt, read(frames))

    return judge
