"""The tiny task's detector as ``compare``'s task metric (entry point ``vllm_omni_mxfp4.task_metrics``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from vllm_omni_mxfp4.compare.report import _accuracy, task_judge
from vllm_omni_mxfp4_tiny import task
from vllm_omni_mxfp4_tiny.task_metric import task_metric
from vllm_omni_mxfp4_tiny.trained_wan import SHIPPED


def test_compare_finds_the_judge_of_a_trained_tiny_model_and_only_there(tmp_path):
    assert task_judge(str(SHIPPED)) is not None  # through the installed entry point
    assert task_judge(str(tmp_path)) is None and task_metric(str(tmp_path)) is None


def test_the_judge_reads_rendered_truth_and_wrong_renders():
    judge = task_metric(str(SHIPPED))
    prompt = task.video_prompts(held_out=False)[0]
    right = task.render_video(prompt, 5)
    other = next(c for c in task.COLOURS if c not in (prompt.colour, prompt.background))
    wrong = task.render_video(dataclasses.replace(prompt, colour=other), 5)
    assert all(judge(prompt.text, right).values())
    assert judge(prompt.text, wrong)["colour"] is False
    assert judge("a cat walking on the grass", right) is None  # not a task prompt: not judged
    assert (
        _accuracy([{"task": judge(prompt.text, right)}, {"task": judge(prompt.text, wrong)}, {"task": None}])
        == 0.5
    )


def test_noise_is_not_the_prompt():
    judge = task_metric(str(SHIPPED))
    prompt = task.video_prompts(held_out=False)[0]
    noise = np.random.default_rng(0).random((9, 32, 32, 3)).astype(np.float32)
    assert not all(judge(prompt.text, noise).values())
