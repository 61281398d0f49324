"""The synthetic task the trained tiny models learn: prompts from a small vocabulary and the videos
and images that match them, drawn from seeds (nothing is downloaded or stored).

A video prompt names a colour, a shape, a motion (direction and speed) and a background::

    a red bar moving left slowly on a black background

and its video shows that shape, filled with that colour, crossing the frames in that direction at
that speed. An image prompt names a colour, a shape, a position and a background::

    a blue square at the top left on a gray background

The vocabulary (:data:`COLOURS`, :data:`SHAPES`, :data:`DIRECTIONS`, :data:`SPEEDS`,
:data:`BACKGROUNDS`, :data:`POSITIONS`) is small enough that every combination can be listed, and
a fixed set of colour × shape pairs (:data:`HELD_OUT_PAIRS`) never appears in training: prompts
with those pairs measure whether a model composes what it learned rather than recalls it.

Rendering is deterministic in the seed: the seed picks the shape's size, a small offset of its path
from the frame's centre (:data:`PATH_JITTER`) and a small brightness jitter; the prompt fixes
everything a detector reads (:mod:`.detect`). Paths are centred rather than placed anywhere because
a prompt that pins its video down up to small jitter is what a model trained for minutes on two CPU
cores can learn: with starts spread over the frame, the first experiments' models drew static blobs. Shapes are drawn
with 4 × 4 supersampling, so edges are anti-aliased as a trained model's outputs are.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

#: Fill colours (RGB in [0, 1]); far apart from each other and from every background.
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.12, 0.10),
    "green": (0.10, 0.80, 0.20),
    "blue": (0.15, 0.30, 0.95),
    "yellow": (0.95, 0.85, 0.10),
}
#: A bar is a 2:1 horizontal rectangle. The shapes differ in what survives a soft, blurred drawing
#: (aspect ratio, how much of the bounding box is filled), not in corners: a first vocabulary had a
#: circle, and the tiny models drew rounded squares for circles and squares alike.
SHAPES = ("square", "bar", "triangle")
DIRECTIONS = ("left", "right", "up", "down")
#: Speed words and how far the shape travels over the whole video, as a share of the frame's extent
#: along its direction (width for left/right, height for up/down), whatever the frame count.
SPEEDS: dict[str, float] = {"slowly": 0.15, "quickly": 0.35}
BACKGROUNDS: dict[str, tuple[float, float, float]] = {"black": (0.05, 0.05, 0.05), "gray": (0.50, 0.50, 0.50)}
#: Image positions and their centres as fractions of (width, height).
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (0.27, 0.27),
    "top right": (0.73, 0.27),
    "bottom left": (0.27, 0.73),
    "bottom right": (0.73, 0.73),
    "center": (0.50, 0.50),
}
#: Colour × shape pairs that no training example shows (every motion, position and background).
HELD_OUT_PAIRS = frozenset({("blue", "triangle"), ("yellow", "bar")})
#: The shape's half-extent, as a fraction of the shorter frame side, is drawn from this range.
SIZE_RANGE = (0.22, 0.27)
#: A video path's midpoint lies within this share of the frame's width (height) of the frame's centre.
PATH_JITTER = 0.06
#: The smallest frame side (pixels) every video prompt fits: the largest shape (plus the one-pixel
#: margin on each side) travelling the fastest speed's share of the side.
MIN_SIDE = math.ceil(2.0 / (1.0 - 2.0 * SIZE_RANGE[1] - max(SPEEDS.values())))
#: Training renders draw their seeds below this; evaluation uses seeds from it up, never seen.
TRAINING_SEEDS = 1_000_000
_DIRECTION_VECTORS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
_SUPERSAMPLE = 4


class _Prompt:
    """What both prompt kinds share: a colour and a shape, the pair training may hold out."""

    colour: str
    shape: str

    @property
    def held_out(self) -> bool:
        """Whether training never shows this prompt's colour × shape pair."""
        return (self.colour, self.shape) in HELD_OUT_PAIRS


@dataclass(frozen=True)
class VideoPrompt(_Prompt):
    """One video prompt: what its video must show."""

    colour: str
    shape: str
    direction: str
    speed: str
    background: str

    def __post_init__(self) -> None:
        _check("colour", self.colour, COLOURS)
        _check("shape", self.shape, SHAPES)
        _check("direction", self.direction, DIRECTIONS)
        _check("speed", self.speed, SPEEDS)
        _check("background", self.background, BACKGROUNDS)

    @property
    def text(self) -> str:
        return f"a {self.colour} {self.shape} moving {self.direction} {self.speed} on a {self.background} background"

    @classmethod
    def parse(cls, text: str) -> VideoPrompt:
        """The prompt that :attr:`text` wrote; anything else is a ``ValueError`` naming the form."""
        words = text.split()
        form = "a COLOUR SHAPE moving DIRECTION SPEED on a BACKGROUND background"
        if len(words) != 10 or words[0] != "a" or words[3] != "moving" or words[6:8] != ["on", "a"]:
            raise ValueError(f"video prompt {text!r}: expected {form!r}")
        if words[9] != "background":
            raise ValueError(f"video prompt {text!r}: expected {form!r}")
        return cls(words[1], words[2], words[4], words[5], words[8])


@dataclass(frozen=True)
class ImagePrompt(_Prompt):
    """One image prompt: what its image must show."""

    colour: str
    shape: str
    position: str
    background: str

    def __post_init__(self) -> None:
        _check("colour", self.colour, COLOURS)
        _check("shape", self.shape, SHAPES)
        _check("position", self.position, POSITIONS)
        _check("background", self.background, BACKGROUNDS)

    @property
    def text(self) -> str:
        where = "in the center" if self.position == "center" else f"at the {self.position}"
        return f"a {self.colour} {self.shape} {where} on a {self.background} background"

    @classmethod
    def parse(cls, text: str) -> ImagePrompt:
        """The prompt that :attr:`text` wrote; anything else is a ``ValueError`` naming the form."""
        form = "a COLOUR SHAPE at the POSITION | in the center on a BACKGROUND background"
        words = text.split()
        if len(words) < 9 or words[0] != "a" or words[-4:-2] != ["on", "a"] or words[-1] != "background":
            raise ValueError(f"image prompt {text!r}: expected {form!r}")
        where = " ".join(words[3:-4])
        if where == "in the center":
            position = "center"
        elif where.startswith("at the "):
            position = where[len("at the ") :]
        else:
            raise ValueError(f"image prompt {text!r}: expected {form!r}")
        return cls(words[1], words[2], position, words[-2])


def _check(field: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{field} {value!r} is not in the task's vocabulary {sorted(allowed)}")


def video_prompts(held_out: bool | None = None) -> list[VideoPrompt]:
    """Every video prompt in a fixed order; only the held-out (True) or the training (False) ones."""
    every = [VideoPrompt(*c) for c in itertools.product(COLOURS, SHAPES, DIRECTIONS, SPEEDS, BACKGROUNDS)]
    return [p for p in every if held_out is None or p.held_out == held_out]


def image_prompts(held_out: bool | None = None) -> list[ImagePrompt]:
    """Every image prompt in a fixed order; only the held-out (True) or the training (False) ones."""
    every = [ImagePrompt(*c) for c in itertools.product(COLOURS, SHAPES, POSITIONS, BACKGROUNDS)]
    return [p for p in every if held_out is None or p.held_out == held_out]


def sample_prompts(prompts: list[VideoPrompt], count: int, seed: int = 0) -> list[VideoPrompt]:
    """``count`` of ``prompts`` drawn without replacement from ``seed``, in their list order: a fixed
    evaluation set that still covers the vocabulary (a stride through the list would not: its
    order cycles the background fastest)."""
    if not 0 < count <= len(prompts):
        raise ValueError(f"sample_prompts: count must be in [1, {len(prompts)}], got {count}")
    picked = np.random.default_rng([seed, 3]).choice(len(prompts), size=count, replace=False)
    return [prompts[i] for i in sorted(picked)]


def shape_coverage(shape: str, cx: float, cy: float, radius: float, height: int, width: int) -> np.ndarray:
    """``(height, width)`` float32 in [0, 1]: how much of each pixel the shape covers.

    Pixel ``(i, j)`` spans ``[j, j + 1) × [i, i + 1)``; the shape is centred on ``(cx, cy)`` with
    half-extent ``radius`` (the bar's half-height is ``radius / 2``; the triangle points up, its
    base at the bottom).
    """
    _check("shape", shape, SHAPES)
    offsets = (np.arange(_SUPERSAMPLE, dtype=np.float64) + 0.5) / _SUPERSAMPLE
    ys = (np.arange(height)[:, None] + offsets[None, :]).reshape(-1) - cy
    xs = (np.arange(width)[:, None] + offsets[None, :]).reshape(-1) - cx
    dy, dx = np.meshgrid(ys, xs, indexing="ij")
    if shape == "square":
        inside = (np.abs(dx) <= radius) & (np.abs(dy) <= radius)
    elif shape == "bar":
        inside = (np.abs(dx) <= radius) & (np.abs(dy) <= radius / 2.0)
    else:
        inside = (np.abs(dy) <= radius) & (np.abs(dx) <= (dy + radius) / 2.0)
    return inside.reshape(height, _SUPERSAMPLE, width, _SUPERSAMPLE).mean(axis=(1, 3)).astype(np.float32)


def _composite(colour, background, coverage: np.ndarray) -> np.ndarray:
    fg = np.asarray(colour, dtype=np.float32)
    bg = np.asarray(background, dtype=np.float32)
    return bg + coverage[..., None] * (fg - bg)


@dataclass(frozen=True)
class Placement:
    """What a seed decides about one rendering: the shape's size, its first centre, a brightness."""

    radius: float
    start: tuple[float, float]
    brightness: float


def video_placement(prompt: VideoPrompt, seed: int, frames: int, height: int, width: int) -> Placement:
    """Size, start and brightness for ``prompt``'s video drawn from ``seed``: the path's midpoint near
    the frame's centre (:data:`PATH_JITTER`), the whole path inside the frame."""
    rng = np.random.default_rng([seed, 1])
    side = min(height, width)
    radius = float(rng.uniform(*SIZE_RANGE)) * side
    vx, vy = _DIRECTION_VECTORS[prompt.direction]
    travel = SPEEDS[prompt.speed] * (width if vx else height)
    margin = radius + 1.0
    lo_x, hi_x = margin - min(0.0, vx) * travel, width - margin - max(0.0, vx) * travel
    lo_y, hi_y = margin - min(0.0, vy) * travel, height - margin - max(0.0, vy) * travel
    if hi_x < lo_x or hi_y < lo_y:
        raise ValueError(
            f"a {height}x{width} frame is too small for {prompt.text!r}: the shape (radius {radius:.1f} px) "
            f"cannot travel {travel:.1f} px inside it; use frames of at least {MIN_SIDE}x{MIN_SIDE} pixels"
        )
    mid_x = width * (0.5 + rng.uniform(-PATH_JITTER, PATH_JITTER))
    mid_y = height * (0.5 + rng.uniform(-PATH_JITTER, PATH_JITTER))
    start = (
        float(np.clip(mid_x - vx * travel / 2, lo_x, hi_x)),
        float(np.clip(mid_y - vy * travel / 2, lo_y, hi_y)),
    )
    return Placement(radius, start, float(rng.uniform(0.92, 1.0)))


def render_video(
    prompt: VideoPrompt, seed: int, *, frames: int = 9, height: int = 32, width: int = 32
) -> np.ndarray:
    """``prompt``'s video for ``seed``: float32 ``(frames, height, width, 3)`` in [0, 1]."""
    place = video_placement(prompt, seed, frames, height, width)
    vx, vy = _DIRECTION_VECTORS[prompt.direction]
    step = SPEEDS[prompt.speed] * (width if vx else height) / max(frames - 1, 1)
    colour = tuple(c * place.brightness for c in COLOURS[prompt.colour])
    out = np.empty((frames, height, width, 3), dtype=np.float32)
    for t in range(frames):
        cx, cy = place.start[0] + vx * step * t, place.start[1] + vy * step * t
        coverage = shape_coverage(prompt.shape, cx, cy, place.radius, height, width)
        out[t] = _composite(colour, BACKGROUNDS[prompt.background], coverage)
    return out


def image_placement(prompt: ImagePrompt, seed: int, height: int, width: int) -> Placement:
    """Size, centre (near the position's anchor) and brightness for ``prompt``'s image from ``seed``."""
    rng = np.random.default_rng([seed, 2])
    side = min(height, width)
    radius = float(rng.uniform(*SIZE_RANGE)) * side
    ax, ay = POSITIONS[prompt.position]
    jitter = 0.05
    centre = (
        float((ax + rng.uniform(-jitter, jitter)) * width),
        float((ay + rng.uniform(-jitter, jitter)) * height),
    )
    return Placement(radius, centre, float(rng.uniform(0.92, 1.0)))


def render_image(prompt: ImagePrompt, seed: int, *, height: int = 32, width: int = 32) -> np.ndarray:
    """``prompt``'s image for ``seed``: float32 ``(height, width, 3)`` in [0, 1]."""
    place = image_placement(prompt, seed, height, width)
    colour = tuple(c * place.brightness for c in COLOURS[prompt.colour])
    coverage = shape_coverage(prompt.shape, *place.start, place.radius, height, width)
    return _composite(colour, BACKGROUNDS[prompt.background], coverage)
