"""The demo's prompt-accuracy sets (vllm_omni_mxfp4_demo/accuracy.py), scored on renders whose answers
are known: the prompted videos and images, and the same ones with another colour or position."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from vllm_omni_mxfp4_demo import accuracy
from vllm_omni_mxfp4_tiny.task import (
    COLOURS,
    HELD_OUT_PAIRS,
    POSITIONS,
    SHAPES,
    TRAINING_SEEDS,
    render_image,
    render_video,
)


def _renders(prompts):
    return np.stack([render_video(p, seed) for p, seed in prompts])


def test_the_video_set_is_unseen_seeds_of_seen_and_held_out_prompts():
    video = accuracy.VIDEO
    requests = video.requests(3)
    assert len(requests) == (video.seen + video.held_out) * 3
    assert len(video.requests()) == video.seen + video.held_out  # one seed by default
    assert all(seed >= TRAINING_SEEDS for _, seed, _ in requests)
    assert all(prompt.held_out == held for prompt, _, held in requests)
    seen = {p for p, _, held in requests if not held}
    assert {p.colour for p in seen} == set(COLOURS) and len({p.direction for p in seen}) == 4
    assert video.job_requests(3)[0] == (requests[0][0].text, requests[0][1])
    with pytest.raises(ValueError, match=r"seed_count must be at least 1, got 0"):
        video.requests(0)


def test_the_image_set_covers_the_vocabulary_on_unseen_seeds():
    image = accuracy.IMAGE
    requests = image.requests(2)
    seen = [p for p, _, held in requests if not held]
    held_out = [p for p, _, held in requests if held]
    assert (len(seen), len(held_out)) == (2 * image.seen, 2 * image.held_out)
    assert all(p.held_out == held for p, _, held in requests)
    assert {s for _, s, _ in requests} == {TRAINING_SEEDS, TRAINING_SEEDS + 1}
    distinct = list(dict.fromkeys(seen))
    assert set(Counter(p.colour for p in distinct)) == set(COLOURS)
    assert set(Counter(p.position for p in distinct)) == set(POSITIONS)
    assert min(Counter(p.position for p in distinct).values()) >= 2
    assert set(Counter(p.shape for p in distinct)) == set(SHAPES)
    assert min(Counter(p.shape for p in distinct).values()) >= 3
    assert {(p.colour, p.shape) for p in held_out} == set(HELD_OUT_PAIRS)
    assert [r[:2] for r in image.requests(1)] == [(p, s) for p, s, _ in requests if s == TRAINING_SEEDS]


def test_prompted_renders_score_every_attribute_and_other_colours_fail_colour():
    video = accuracy.VIDEO
    requests = video.requests(2)
    right = video.score(_renders([(p, s) for p, s, _ in requests]), 2)
    assert right["seen"]["accuracy"] == 1.0 and right["held_out"]["accuracy"] == 1.0
    assert right["seen"]["outputs"] == video.seen * 2
    names = list(COLOURS)
    shifted = [
        (dataclasses.replace(p, colour=names[(names.index(p.colour) + 1) % 4]), s) for p, s, _ in requests
    ]
    wrong = video.score(_renders(shifted), 2)
    assert wrong["seen"]["accuracy"] == 0.0 and wrong["seen"]["per_attribute"]["colour"] == 0.0
    assert wrong["seen"]["per_attribute"]["direction"] == 1.0


def test_images_in_the_engines_layout_score_position_and_a_moved_shape_fails_it():
    """One image per request as the engine job stores it, (1, H, W, 3): the prompted renders score
    every attribute; the same shapes in the opposite corner fail position only."""
    image = accuracy.IMAGE
    requests = image.requests(1)
    right = image.score(np.stack([render_image(p, s)[None] for p, s, _ in requests]))
    assert right["seen"]["accuracy"] == right["held_out"]["accuracy"] == 1.0
    assert set(right["seen"]["per_attribute"]) == {"colour", "shape", "position", "background"}
    names = list(POSITIONS)
    moved = [
        dataclasses.replace(p, position=names[(names.index(p.position) + len(names) // 2) % len(names)])
        for p, _, _ in requests
    ]
    wrong = image.score(np.stack([render_image(p, s)[None] for p, (_, s, _) in zip(moved, requests)]))
    assert (
        wrong["seen"]["per_attribute"]["position"] < 0.5 and wrong["seen"]["per_attribute"]["colour"] == 1.0
    )


def test_a_wrong_number_of_outputs_is_refused():
    videos = _renders([(p, s) for p, s, _ in accuracy.VIDEO.requests(3)[:3]])
    with pytest.raises(ValueError, match=r"expected 36 videos, one per request, got 3"):
        accuracy.VIDEO.score(videos, 3)
