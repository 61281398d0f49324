"""A detector with no learned weights: what a generated video or image of the task (:mod:`.task`)
shows, read with numpy, and whether that is what its prompt asked for.

How it reads a video (an image is a video of one frame):

- **background**: the median of the frame border, matched to the nearest background colour;
- **object**: the pixels farther than :data:`FOREGROUND_DISTANCE` from that background. A frame
  whose object is smaller than :data:`MIN_AREA` or larger than :data:`MAX_AREA` of the frame has
  none (noise, an empty frame or a washed-out one);
- **colour**: the mean of the object's interior pixels, matched to the nearest fill colour;
- **shape**: how much of its bounding box the object fills (square and bar ≈ 1, triangle ≈ 1/2)
  and the box's width over its height (square and triangle ≈ 1, bar ≈ 2), with each pixel counted
  for the share of it the object covers, the medians over frames where the object does not touch the
  border;
- **motion**: a straight line fitted to the object's centroid over the frames; the larger component
  of its velocity gives the direction, and the distance it travels over the video (a share of the
  frame) is compared with the geometric mean of the two of :data:`~.task.SPEEDS`;
- **position** (images): the nearest of :data:`~.task.POSITIONS`.

Every reading that is not clear gives ``None`` (no match to any colour within
:data:`MATCH_DISTANCE`, no motion above :data:`STILL_SPEED`, no object), which never matches a
prompt. :func:`prompt_accuracy` counts an output as correct only when every attribute its prompt
names was read as prompted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from .task import BACKGROUNDS, COLOURS, POSITIONS, SPEEDS, ImagePrompt, VideoPrompt

#: A pixel belongs to the object when its RGB distance from the background exceeds this.
FOREGROUND_DISTANCE = 0.25
#: A colour or background reading farther than this (RGB distance) from every palette entry is None.
MATCH_DISTANCE = 0.35
#: The object's share of the frame must lie in [MIN_AREA, MAX_AREA].
MIN_AREA, MAX_AREA = 0.01, 0.35
#: Below this fill of its bounding box the object is a triangle (1/2); a square or bar fills ≈ 1,
#: a blurred one with rounded corners ≈ 0.8.
TRIANGLE_FILL = 0.7
#: Width over height: at least BAR_ASPECT is a bar (2), within [1/BAR_ASPECT, BAR_ASPECT] a square or
#: triangle (1); a tall object is no shape of the vocabulary.
BAR_ASPECT = math.sqrt(2.0)
#: Travelling less than this share of the frame over the video is no motion at all.
STILL_SPEED = 0.05
#: Frames in which the object was found: at least this share of the video, or nothing is read.
MIN_FRAMES_FOUND = 0.75


@dataclass(frozen=True)
class Reading:
    """What the detector read; ``None`` where it could not tell."""

    background: str | None = None
    colour: str | None = None
    shape: str | None = None
    direction: str | None = None
    speed: str | None = None
    position: str | None = None


def _nearest(value: np.ndarray, palette: dict[str, tuple[float, float, float]]) -> str | None:
    name, distance = min(
        ((n, float(np.linalg.norm(value - np.asarray(c)))) for n, c in palette.items()), key=lambda x: x[1]
    )
    return name if distance <= MATCH_DISTANCE else None


def _as_frames(pixels: np.ndarray) -> np.ndarray:
    array = np.asarray(pixels, dtype=np.float32)
    if array.ndim == 5 and array.shape[0] == 1:  # (1, F, H, W, 3) as Wan2.2's engine returns it
        array = array[0]
    if array.ndim == 3:
        array = array[None]
    if array.ndim != 4 or array.shape[-1] != 3:
        raise ValueError(
            f"detector: expected (F, H, W, 3) or (H, W, 3) RGB in [0, 1], got shape {np.shape(pixels)}"
        )
    if not np.isfinite(array).all():
        raise ValueError("detector: the pixels hold NaN or infinity")
    return np.clip(array, 0.0, 1.0)


def _border(frames: np.ndarray) -> np.ndarray:
    return np.concatenate(
        [
            frames[:, 0].reshape(-1, 3),
            frames[:, -1].reshape(-1, 3),
            frames[:, :, 0].reshape(-1, 3),
            frames[:, :, -1].reshape(-1, 3),
        ]
    )


@dataclass(frozen=True)
class _Object:
    core: np.ndarray  # (H, W) bool: the object's interior pixels (its colour)
    centroid: tuple[float, float]  # (x, y) in pixels, pixel centres at +0.5
    fill: float
    aspect: float  # width over height of the coverage's extents
    touches_border: bool


def _object(frame: np.ndarray, background: np.ndarray) -> _Object | None:
    """The object of one frame, or None. Its coverage of each pixel is estimated from the pixel's
    distance to the background relative to the interior's, so that the fill ratio is measured with
    sub-pixel extents (a 10-pixel triangle's apex row counts for what it covers)."""
    height, width, _ = frame.shape
    distance = np.linalg.norm(frame - background, axis=-1)
    mask = distance > FOREGROUND_DISTANCE
    area = int(mask.sum())
    if not MIN_AREA <= area / (height * width) <= MAX_AREA:
        return None
    rows, cols = np.nonzero(mask)
    top, bottom, left, right = rows.min(), rows.max(), cols.min(), cols.max()
    core = mask & (distance >= 0.8 * distance[mask].max())
    inside = float(np.linalg.norm(frame[core].mean(axis=0) - background))
    floor = 0.5 * FOREGROUND_DISTANCE
    coverage = np.clip((distance - floor) / max(inside - floor, 1e-3), 0.0, 1.0)
    window = np.zeros_like(mask)  # the mask's bounding box grown by one pixel: the edge pixels
    window[max(top - 1, 0) : bottom + 2, max(left - 1, 0) : right + 2] = True
    coverage = np.where(window, coverage, 0.0)
    extent_x, extent_y = float(coverage.max(axis=0).sum()), float(coverage.max(axis=1).sum())
    ys, xs = np.mgrid[0:height, 0:width]
    total = float(coverage.sum())
    centroid = (float((coverage * xs).sum() / total) + 0.5, float((coverage * ys).sum() / total) + 0.5)
    touches = top == 0 or left == 0 or bottom == height - 1 or right == width - 1
    return _Object(core, centroid, total / (extent_x * extent_y), extent_x / extent_y, bool(touches))


def _shape(fill: float, aspect: float) -> str | None:
    if aspect >= BAR_ASPECT:
        return "bar" if fill >= TRIANGLE_FILL else None
    if aspect <= 1.0 / BAR_ASPECT:
        return None
    return "square" if fill >= TRIANGLE_FILL else "triangle"


def read(pixels: np.ndarray) -> Reading:
    """What ``pixels`` (a video ``(F, H, W, 3)``, ``(1, F, H, W, 3)``, or an image ``(H, W, 3)``,
    RGB in [0, 1]) shows. Position is read for single images, motion for videos."""
    frames = _as_frames(pixels)
    count, height, width, _ = frames.shape
    border = np.median(_border(frames), axis=0)
    background = _nearest(border, BACKGROUNDS)
    objects = [_object(frame, border) for frame in frames]
    found = [(t, o) for t, o in enumerate(objects) if o is not None]
    if len(found) < MIN_FRAMES_FOUND * count:
        return Reading(background=background)
    pixels_in = np.concatenate([frames[t][o.core] for t, o in found])
    colour = _nearest(pixels_in.mean(axis=0), COLOURS)
    inside = [o for _, o in found if not o.touches_border] or [o for _, o in found]
    shape = _shape(float(np.median([o.fill for o in inside])), float(np.median([o.aspect for o in inside])))
    if count == 1:
        cx, cy = found[0][1].centroid
        position = min(
            POSITIONS, key=lambda p: math.hypot(cx / width - POSITIONS[p][0], cy / height - POSITIONS[p][1])
        )
        return Reading(background=background, colour=colour, shape=shape, position=position)
    times = np.asarray([t for t, _ in found], dtype=np.float64)
    xs = np.asarray([o.centroid[0] for _, o in found])
    ys = np.asarray([o.centroid[1] for _, o in found])
    # travel over the whole video, as a share of the frame's width and height (task.SPEEDS)
    vx = float(np.polyfit(times, xs, 1)[0]) * (count - 1) / width
    vy = float(np.polyfit(times, ys, 1)[0]) * (count - 1) / height
    speed_value = math.hypot(vx, vy)
    if speed_value < STILL_SPEED:
        return Reading(background=background, colour=colour, shape=shape)
    if abs(vx) >= abs(vy):
        direction = "right" if vx > 0 else "left"
    else:
        direction = "down" if vy > 0 else "up"
    boundary = math.sqrt(SPEEDS["slowly"] * SPEEDS["quickly"])
    speed = "quickly" if speed_value >= boundary else "slowly"
    return Reading(background=background, colour=colour, shape=shape, direction=direction, speed=speed)


def matches(prompt: VideoPrompt | ImagePrompt, reading: Reading) -> dict[str, bool]:
    """Per attribute the prompt names: whether the reading shows it."""
    return {f.name: getattr(reading, f.name) == getattr(prompt, f.name) for f in fields(prompt)}


@dataclass(frozen=True)
class Accuracy:
    """Prompt accuracy over a set of outputs: the share whose every attribute matched, and per attribute."""

    outputs: int
    correct: int
    per_attribute: dict[str, float]

    @property
    def value(self) -> float:
        return self.correct / self.outputs if self.outputs else float("nan")


def prompt_accuracy(pairs: Sequence[tuple[VideoPrompt | ImagePrompt, np.ndarray]]) -> Accuracy:
    """Prompt accuracy of ``(prompt, pixels)`` pairs (see the module)."""
    results = [matches(prompt, read(pixels)) for prompt, pixels in pairs]
    names = list(results[0]) if results else []
    per_attribute = {n: float(np.mean([r[n] for r in results])) for n in names}
    return Accuracy(len(results), sum(all(r.values()) for r in results), per_attribute)
