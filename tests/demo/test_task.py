"""The trained tiny models' synthetic task (:mod:`vllm_omni_mxfp4_tiny.task`) and its detector
(:mod:`vllm_omni_mxfp4_tiny.detect`): prompts, renders with known answers, wrong renders and noise."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vllm_omni_mxfp4_tiny import detect, task

VIDEO = task.VideoPrompt("red", "bar", "left", "slowly", "black")
IMAGE = task.ImagePrompt("green", "triangle", "top right", "gray")


# ----------------------------------------------------------------------------- prompts


def test_every_prompt_reads_back_from_its_text():
    for prompt in task.video_prompts():
        assert task.VideoPrompt.parse(prompt.text) == prompt
    for prompt in task.image_prompts():
        assert task.ImagePrompt.parse(prompt.text) == prompt
    assert VIDEO.text == "a red bar moving left slowly on a black background"
    assert IMAGE.text == "a green triangle at the top right on a gray background"
    assert dataclasses.replace(IMAGE, position="center").text.endswith("in the center on a gray background")


@pytest.mark.parametrize(
    "text",
    [
        "a red bar moving left slowly on a black",  # cut short
        "a red bar going left slowly on a black background",
        "one red bar moving left slowly on a black background",
    ],
)
def test_a_malformed_video_prompt_names_the_expected_form(text):
    with pytest.raises(ValueError, match="expected 'a COLOUR SHAPE moving DIRECTION SPEED on a BACKGROUND"):
        task.VideoPrompt.parse(text)


def test_a_word_outside_the_vocabulary_is_refused_by_field():
    with pytest.raises(
        ValueError, match=r"colour 'purple' is not in the task's vocabulary \['blue', 'green'"
    ):
        task.VideoPrompt.parse(VIDEO.text.replace("red", "purple"))
    with pytest.raises(ValueError, match="position 'middle left' is not in the task's vocabulary"):
        task.ImagePrompt.parse(IMAGE.text.replace("top right", "middle left"))
    with pytest.raises(ValueError, match="expected 'a COLOUR SHAPE at the POSITION"):
        task.ImagePrompt.parse(IMAGE.text.replace("at the", "near the"))


def test_held_out_pairs_never_appear_in_training_prompts():
    train, held = task.video_prompts(held_out=False), task.video_prompts(held_out=True)
    assert len(train) + len(held) == len(task.video_prompts()) == 4 * 3 * 4 * 2 * 2
    assert {(p.colour, p.shape) for p in held} == set(task.HELD_OUT_PAIRS)
    assert not {(p.colour, p.shape) for p in train} & task.HELD_OUT_PAIRS
    # every colour and every shape is still seen in training, only the pairs are new
    assert {p.colour for p in train} == set(task.COLOURS) and {p.shape for p in train} == set(task.SHAPES)
    images = task.image_prompts(held_out=True)
    assert images and all((p.colour, p.shape) in task.HELD_OUT_PAIRS for p in images)


# ----------------------------------------------------------------------------- renderer


@pytest.mark.parametrize(("shape", "area"), [("square", 4.0), ("bar", 2.0), ("triangle", 2.0)])
def test_coverage_integrates_to_the_shapes_area(shape, area):
    """The anti-aliased coverage sums to the analytic area (r² × 4, 2, 2) within the 1/4-pixel
    supersampling grid (3 % at this size)."""
    radius = 6.3
    coverage = task.shape_coverage(shape, 16.2, 15.7, radius, 32, 32)
    assert coverage.min() >= 0.0 and coverage.max() == 1.0
    assert coverage.sum() == pytest.approx(area * radius * radius, rel=0.03)
    assert coverage[coverage < 1.0].max() > 0.0  # edges are partial


def test_renders_are_deterministic_in_the_seed_and_stay_inside_the_frame():
    first, again, other = (task.render_video(VIDEO, s) for s in (3, 3, 4))
    assert first.shape == (9, 32, 32, 3) and first.dtype == np.float32
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    for prompt in task.video_prompts()[::7]:
        video = task.render_video(prompt, 11, frames=17, height=48, width=64)
        background = np.asarray(task.BACKGROUNDS[prompt.background], dtype=np.float32)
        border = np.concatenate([video[:, 0], video[:, -1], video[:, :, 0], video[:, :, -1]], axis=1)
        assert np.allclose(border, background, atol=1e-6), prompt.text


def test_paths_are_centred_up_to_the_jitter():
    # A prompt pins its video down: the path's midpoint (mean of the first and last frames' centres of
    # mass) is within PATH_JITTER of the frame's centre, whatever the seed, direction and speed.
    limit = task.PATH_JITTER * 32 + 0.05
    midpoints = []
    for prompt in task.video_prompts()[::5]:
        if prompt.shape == "triangle":  # its centre of mass is not its centre
            continue
        for seed in range(3):
            video = task.render_video(prompt, seed)
            mass = np.linalg.norm(video - np.asarray(task.BACKGROUNDS[prompt.background]), axis=-1)
            ys, xs = np.arange(32).reshape(1, -1, 1), np.arange(32).reshape(1, 1, -1)
            cy = (mass * ys).sum(axis=(1, 2)) / mass.sum(axis=(1, 2)) + 0.5
            cx = (mass * xs).sum(axis=(1, 2)) / mass.sum(axis=(1, 2)) + 0.5
            mid = np.array([(cx[0] + cx[-1]) / 2, (cy[0] + cy[-1]) / 2])
            assert np.all(np.abs(mid - 16.0) <= limit), (prompt.text, seed, mid)
            midpoints.append(mid)
    assert np.ptp(np.array(midpoints), axis=0).min() > 1.0  # the seed does move it


def test_a_frame_too_small_for_the_path_is_refused():
    side = task.MIN_SIDE  # the smallest size the message recommends: every prompt and seed fits it
    for prompt in task.video_prompts(held_out=False)[::7]:
        for seed in range(4):
            task.render_video(prompt, seed, height=side, width=side)
    fast = dataclasses.replace(VIDEO, speed="quickly")
    with pytest.raises(
        ValueError,
        match=rf"a 16x16 frame is too small for 'a red bar moving left quickly.*at least {side}x{side}",
    ):
        task.render_video(fast, 0, height=16, width=16)


def test_the_shape_travels_its_speeds_share_of_the_frame():
    # edges are drawn on a 1/4-pixel supersampling grid, so a straight edge's position (and the centre
    # of mass) is exact to 1/4 pixel per frame, and over the whole path
    for shape in task.SHAPES:
        for speed, share in task.SPEEDS.items():
            for direction, axis, extent in (("right", 2, 40), ("down", 1, 24)):
                prompt = dataclasses.replace(VIDEO, shape=shape, direction=direction, speed=speed)
                video = task.render_video(prompt, 5, frames=9, width=40, height=24)
                mass = np.linalg.norm(video - np.asarray(task.BACKGROUNDS["black"]), axis=-1)
                index = np.arange(video.shape[axis]).reshape((1, -1, 1) if axis == 1 else (1, 1, -1))
                centre = (mass * index).sum(axis=(1, 2)) / mass.sum(axis=(1, 2))
                label = (shape, speed, direction)
                assert centre[-1] - centre[0] == pytest.approx(share * extent, abs=0.25), label
                assert np.diff(centre) == pytest.approx(np.full(8, share * extent / 8), abs=0.25), label


# ----------------------------------------------------------------------------- detector


def test_every_rendered_video_is_read_as_prompted():
    pairs = [(p, task.render_video(p, seed)) for p in task.video_prompts() for seed in (0, 1)]
    accuracy = detect.prompt_accuracy(pairs)
    assert accuracy.value == 1.0 and accuracy.outputs == 2 * len(task.video_prompts())
    assert set(accuracy.per_attribute) == {"colour", "shape", "direction", "speed", "background"}


def test_every_rendered_image_is_read_as_prompted_at_two_sizes():
    for height, width in ((32, 32), (48, 64)):
        pairs = [
            (p, task.render_image(p, s, height=height, width=width))
            for p in task.image_prompts()
            for s in range(3)
        ]
        assert detect.prompt_accuracy(pairs).value == 1.0, (height, width)


def test_the_engine_output_layout_is_read_too():
    video = task.render_video(VIDEO, 2)
    assert detect.read(video[None]) == detect.read(video)


def test_wrong_renders_fail_on_the_attribute_that_is_wrong():
    for wrong in (
        dataclasses.replace(VIDEO, colour="blue"),
        dataclasses.replace(VIDEO, shape="square"),
        dataclasses.replace(VIDEO, direction="up"),
        dataclasses.replace(VIDEO, speed="quickly"),
        dataclasses.replace(VIDEO, background="gray"),
    ):
        got = detect.matches(VIDEO, detect.read(task.render_video(wrong, 0)))
        assert [name for name, ok in got.items() if not ok] == [
            name for name in got if getattr(wrong, name) != getattr(VIDEO, name)
        ], wrong.text
    reversed_video = task.render_video(VIDEO, 0)[::-1]
    assert detect.read(reversed_video).direction == "right"
    moved = task.render_image(dataclasses.replace(IMAGE, position="bottom left"), 0)
    assert detect.matches(IMAGE, detect.read(moved)) == {
        "colour": True,
        "shape": True,
        "position": False,
        "background": True,
    }


def _blurred(pixels: np.ndarray, passes: int) -> np.ndarray:
    """``pixels`` (..., H, W, 3) smoothed by ``passes`` 3 x 3 box filters (edge-replicated): soft,
    round-cornered shapes as a small generator draws them."""
    out = pixels
    for _ in range(passes):
        padded = np.pad(out, [(0, 0)] * (out.ndim - 3) + [(1, 1), (1, 1), (0, 0)], mode="edge")
        h, w = out.shape[-3], out.shape[-2]
        out = sum(padded[..., i : i + h, j : j + w, :] for i in range(3) for j in range(3)) / 9.0
    return out


def test_shapes_are_read_through_blur_that_rounds_their_corners():
    # what tells the shapes apart (fill and aspect ratio) survives the blur of a soft drawing
    for shape in task.SHAPES:
        for seed in range(3):
            prompt = dataclasses.replace(VIDEO, shape=shape)
            video = _blurred(task.render_video(prompt, seed), passes=2)
            assert detect.read(video).shape == shape, (shape, seed)


def test_a_tall_object_is_no_shape_of_the_vocabulary():
    bar = task.render_image(dataclasses.replace(IMAGE, shape="bar", position="center"), 0)
    assert detect.read(bar).shape == "bar"
    assert detect.read(bar.transpose(1, 0, 2)).shape is None


def test_noise_and_empty_frames_show_nothing():
    rng = np.random.default_rng(0)
    for pixels in (
        rng.random((9, 32, 32, 3), dtype=np.float32),
        np.zeros((9, 32, 32, 3), np.float32),
        np.full((32, 32, 3), 0.5, np.float32),
    ):
        reading = detect.read(pixels)
        assert (reading.colour, reading.shape, reading.direction, reading.position) == (
            None,
            None,
            None,
            None,
        )
    noise = [(p, rng.random((9, 32, 32, 3), dtype=np.float32)) for p in task.video_prompts()[:20]]
    assert detect.prompt_accuracy(noise).value == 0.0


def test_a_still_shape_has_no_motion():
    frame = task.render_image(IMAGE, 0)
    reading = detect.read(np.stack([frame] * 9))
    assert (reading.colour, reading.shape, reading.direction, reading.speed) == (
        "green",
        "triangle",
        None,
        None,
    )


def test_bad_pixels_are_refused_with_what_was_expected():
    with pytest.raises(
        ValueError, match=r"expected \(F, H, W, 3\) or \(H, W, 3\) RGB in \[0, 1\], got shape \(9, 32, 32\)"
    ):
        detect.read(np.zeros((9, 32, 32), np.float32))
    video = task.render_video(VIDEO, 0)
    video[3, 4, 5, 1] = np.nan
    with pytest.raises(ValueError, match="NaN or infinity"):
        detect.read(video)
