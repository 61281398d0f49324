"""Frames out of ``Omni.generate`` results, and videos and frame strips out of frames.

vLLM-Omni's Wan2.2 pipeline returns one ``OmniRequestOutput`` per prompt whose ``images[0]`` is the
video as float32 ``(1, F, H, W, 3)`` in ``[0, 1]``. :func:`video_frames` turns that (or a tensor,
or channel-first layouts) into ``(F, H, W, 3)`` float32; :func:`write_video` writes MP4 (H.264 via
imageio-ffmpeg or PyAV) or, where no encoder is installed, an animated GIF (Pillow).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def video_frames(output: Any) -> np.ndarray:
    """The frames of a video generation result as float32 ``(F, H, W, 3)`` in ``[0, 1]``.

    ``output`` is what ``Omni.generate`` returns (a list of request outputs), one request output
    (``.images[0]``), or the array/tensor itself: ``(B, F, H, W, C)``, ``(F, H, W, C)`` or the
    channel-first ``(B, C, F, H, W)`` / ``(C, F, H, W)``.
    """
    if isinstance(output, (list, tuple)):
        if not output:
            raise ValueError("the generation returned no outputs")
        output = output[0]
    images = getattr(output, "images", None)
    if images is not None:
        if not images:
            raise ValueError("the generation output has no images/video")
        output = images[0]
    if hasattr(output, "detach"):  # a torch tensor
        output = output.detach().float().cpu().numpy()
    frames = np.asarray(output)
    if frames.ndim == 5:
        if frames.shape[0] != 1:
            raise ValueError(f"expected one video, got a batch of {frames.shape[0]} {frames.shape}")
        frames = frames[0]
    if frames.ndim != 4:
        raise ValueError(f"expected video frames (F, H, W, C), got shape {frames.shape}")
    if frames.shape[-1] not in (1, 3, 4) and frames.shape[0] in (1, 3, 4):
        frames = np.moveaxis(frames, 0, -1)  # (C, F, H, W) -> (F, H, W, C)
    if frames.shape[-1] == 1:
        frames = np.repeat(frames, 3, axis=-1)
    frames = frames[..., :3]
    if np.issubdtype(frames.dtype, np.integer):
        return frames.astype(np.float32) / 255.0
    return frames.astype(np.float32)


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """``[0, 1]`` floats to uint8 (clipped, rounded)."""
    return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def upscale(frames: np.ndarray, factor: int) -> np.ndarray:
    """Nearest-neighbour upscaling of ``(..., H, W, C)`` by an integer factor (1 = unchanged)."""
    if factor <= 1:
        return frames
    return frames.repeat(factor, axis=-3).repeat(factor, axis=-2)


def video_encoder() -> str | None:
    """The MP4 encoder available here: ``"imageio-ffmpeg"``, ``"pyav"`` or None."""
    if importlib.util.find_spec("imageio") and importlib.util.find_spec("imageio_ffmpeg"):
        return "imageio-ffmpeg"
    if importlib.util.find_spec("av"):
        return "pyav"
    return None


def _write_mp4_imageio(frames: np.ndarray, path: Path, fps: float) -> None:
    import imageio.v2 as imageio

    # macro_block_size=1 keeps the exact size; H.264 with yuv420p needs even sides (see write_video).
    imageio.mimwrite(path, list(frames), fps=fps, codec="libx264", macro_block_size=1, quality=8)


def _write_mp4_pyav(frames: np.ndarray, path: Path, fps: float) -> None:
    from fractions import Fraction

    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        stream.height, stream.width = frames.shape[1], frames.shape[2]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _write_gif(frames: np.ndarray, path: Path, fps: float) -> None:
    from PIL import Image

    images = [Image.fromarray(frame) for frame in frames]
    duration_ms = max(int(round(1000.0 / fps)), 20)
    images[0].save(path, save_all=True, append_images=images[1:], duration=duration_ms, loop=0)


def write_video(frames: np.ndarray, path: str | Path, fps: float = 16.0) -> Path:
    """Write ``(F, H, W, 3)`` frames in ``[0, 1]`` as a video; returns the path actually written.

    ``.mp4`` (any suffix but ``.gif``) is encoded with H.264 when an encoder is installed
    (:func:`video_encoder`); odd heights/widths are padded by one edge row/column, as yuv420p
    needs even sizes. Without an encoder, or for a ``.gif`` path, an animated GIF is written
    next to it (same stem, ``.gif``), and a warning names the missing package.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = to_uint8(np.asarray(frames))
    if data.ndim != 4 or data.shape[-1] != 3:
        raise ValueError(f"write_video: expected frames (F, H, W, 3), got shape {data.shape}")
    encoder = None if path.suffix.lower() == ".gif" else video_encoder()
    if encoder is None:
        if path.suffix.lower() != ".gif":
            logger.warning(
                "No MP4 encoder installed (pip install imageio imageio-ffmpeg, or av); writing a GIF instead."
            )
            path = path.with_suffix(".gif")
        _write_gif(data, path, fps)
        return path
    pad_h, pad_w = data.shape[1] % 2, data.shape[2] % 2
    if pad_h or pad_w:
        data = np.pad(data, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    if encoder == "imageio-ffmpeg":
        _write_mp4_imageio(data, path, fps)
    else:
        _write_mp4_pyav(data, path, fps)
    return path


def frame_strip(
    rows: Sequence[tuple[str, np.ndarray]],
    path: str | Path,
    *,
    max_frames: int = 9,
    min_size: int = 96,
) -> Path:
    """A PNG with one labelled row of frames per entry of ``rows`` (``(label, (F, H, W, 3))``).

    Up to ``max_frames`` frames per row, evenly spaced over the video; frames smaller than
    ``min_size`` pixels are enlarged by an integer factor (nearest neighbour) so they stay visible.
    """
    from PIL import Image, ImageDraw

    if not rows:
        raise ValueError("frame_strip: no rows")
    height, width = rows[0][1].shape[1:3]
    factor = max(1, -(-min_size // min(height, width)))
    fh, fw = height * factor, width * factor
    count = min(max_frames, min(f.shape[0] for _, f in rows))
    label_w, gap = 150, 4
    canvas = Image.new("RGB", (label_w + count * (fw + gap), len(rows) * (fh + gap)), "white")
    draw = ImageDraw.Draw(canvas)
    for r, (label, frames) in enumerate(rows):
        if frames.shape[1:3] != (height, width):
            raise ValueError(
                f"frame_strip: row {label!r} has frames {frames.shape[1:3]}, expected {(height, width)}"
            )
        picks = np.linspace(0, frames.shape[0] - 1, count).round().astype(int)
        y = r * (fh + gap)
        draw.text((6, y + fh // 2 - 6), label, fill="black")
        for c, index in enumerate(picks):
            tile = Image.fromarray(upscale(to_uint8(frames[index]), factor))
            canvas.paste(tile, (label_w + c * (fw + gap), y))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)
    return path
