"""The demo's prompt-accuracy set (vllm_omni_mxfp4_demo/accuracy.py), scored on renders whose answers
are known: the prompted videos, and the same videos with another colour."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vllm_omni_mxfp4_demo import accuracy
from vllm_omni_mxfp4_tiny.task import COLOURS, TRAINING_SEEDS, render_video


def _renders(prompts):
    return np.stack([render_video(p, seed) for p, seed in prompts])


def test_the_set_is_unseen_seeds_of_seen_and_held_out_prompts():
    requests = accuracy.requests(3)
    assert len(requests) == (accuracy.SEEN + accuracy.HELD_OUT) * 3
    assert len(accuracy.requests()) == accuracy.SEEN + accuracy.HELD_OUT  # one seed by default
    assert all(seed >= TRAINING_SEEDS for _, seed, _ in requests)
    assert all(prompt.held_out == held for prompt, _, held in requests)
    seen = {p for p, _, held in requests if not held}
    assert {p.colour for p in seen} == set(COLOURS) and len({p.direction for p in seen}) == 4
    assert accuracy.job_requests(3)[0] == (requests[0][0].text, requests[0][1])
    with pytest.raises(ValueError, match=r"seed_count must be at least 1, got 0"):
        accuracy.requests(0)


def test_prompted_renders_score_every_attribute_and_other_colours_fail_colour():
    requests = accuracy.requests(2)
    right = accuracy.score(_renders([(p, s) for p, s, _ in requests]), 2)
    assert right["seen"]["accuracy"] == 1.0 and right["held_out"]["accuracy"] == 1.0
    assert right["seen"]["videos"] == accuracy.SEEN * 2
    names = list(COLOURS)
    shifted = [
        (dataclasses.replace(p, colour=names[(names.index(p.colour) + 1) % 4]), s) for p, s, _ in requests
    ]
    wrong = accuracy.score(_renders(shifted), 2)
    assert wrong["seen"]["accuracy"] == 0.0 and wrong["seen"]["per_attribute"]["colour"] == 0.0
    assert wrong["seen"]["per_attribute"]["direction"] == 1.0


def test_a_wrong_number_of_videos_is_refused():
    videos = _renders([(p, s) for p, s, _ in accuracy.requests(3)[:3]])
    with pytest.raises(ValueError, match=r"expected 36 videos, one per request, got 3"):
        accuracy.score(videos, 3)
