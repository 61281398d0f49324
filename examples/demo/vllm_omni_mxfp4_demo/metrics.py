"""Quality of generated frames against a reference video (float64 arithmetic)."""

from __future__ import annotations

import math

import numpy as np


def _pair(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"frames have different shapes: {a.shape} vs {b.shape}")
    if a.size == 0:
        raise ValueError("frames are empty")
    return a, b


def psnr(frames: np.ndarray, reference: np.ndarray, peak: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB of ``frames`` against ``reference`` (values in ``[0, peak]``).

    ``inf`` when the two are identical; ``nan`` when either holds a non-finite value.
    """
    a, b = _pair(frames, reference)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return math.nan
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(peak * peak / mse)


def cosine(frames: np.ndarray, reference: np.ndarray) -> float:
    """Cosine similarity of the two videos as vectors of signed pixels (``[0, 1]`` mapped to ``[-1, 1]``).

    Centring on mid-grey keeps the measure informative: raw ``[0, 1]`` pixels are all positive, so
    any two videos would score close to 1. ``nan`` for non-finite values or an all-grey video.
    """
    a, b = _pair(frames, reference)
    a, b = a.ravel() * 2.0 - 1.0, b.ravel() * 2.0 - 1.0
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return math.nan
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    return math.nan if norm == 0.0 else float(np.dot(a, b) / norm)
