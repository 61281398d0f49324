"""How far a generation is from its BF16 reference: frames (PSNR, SSIM, cosine) and latents (cosine,
MSE), in float64 with numpy only.

The frame measures take pixels in ``[0, 1]`` (what vLLM-Omni's pipelines return), any shape with the
channels last; the latent measures take any two arrays of one shape (upstream's
``compare_diffusion_trajectory_similarity`` reports the same two per step).
"""

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


SSIM_WINDOW = 11
"""Side of SSIM's Gaussian window (Wang et al. 2004: 11 x 11, sigma 1.5), shrunk to the frame when smaller."""
SSIM_SIGMA = 1.5
SSIM_K = (0.01, 0.03)


def _gaussian(size: int, sigma: float) -> np.ndarray:
    x = np.arange(size, dtype=np.float64) - (size - 1) / 2.0
    w = np.exp(-(x * x) / (2.0 * sigma * sigma))
    return w / w.sum()


def _filter(image: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The ``valid`` separable convolution of ``(..., H, W)`` with ``w`` along H and W."""
    size = len(w)
    rows = sum(w[i] * image[..., i : image.shape[-2] - size + 1 + i, :] for i in range(size))
    return sum(w[i] * rows[..., :, i : rows.shape[-1] - size + 1 + i] for i in range(size))


def ssim(frames: np.ndarray, reference: np.ndarray, peak: float = 1.0) -> float:
    """Mean structural similarity of ``frames`` against ``reference`` (``(..., H, W, C)``, values in
    ``[0, peak]``): each channel of each frame with the Gaussian window, then the mean. 1.0 for equal
    frames; ``nan`` for non-finite values."""
    a, b = _pair(frames, reference)
    if a.ndim < 3:
        raise ValueError(f"frames must be (..., H, W, C), got shape {a.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return math.nan
    a, b = np.moveaxis(a, -1, -3), np.moveaxis(b, -1, -3)  # (..., C, H, W)
    size = min(SSIM_WINDOW, a.shape[-1], a.shape[-2])
    w = _gaussian(size, SSIM_SIGMA * size / SSIM_WINDOW)
    c1, c2 = (SSIM_K[0] * peak) ** 2, (SSIM_K[1] * peak) ** 2
    mu_a, mu_b = _filter(a, w), _filter(b, w)
    var_a = _filter(a * a, w) - mu_a * mu_a
    var_b = _filter(b * b, w) - mu_b * mu_b
    cov = _filter(a * b, w) - mu_a * mu_b
    index = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return float(index.mean())


def latent_cosine(latents: np.ndarray, reference: np.ndarray) -> float:
    """Cosine similarity of two latents as flat vectors (``nan`` for a zero or non-finite one)."""
    a, b = _pair(latents, reference)
    a, b = a.ravel(), b.ravel()
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    if not np.isfinite(norm) or norm == 0.0:
        return math.nan
    return float(np.dot(a, b) / norm)


def mse(latents: np.ndarray, reference: np.ndarray) -> float:
    """Mean squared difference of two arrays of one shape."""
    a, b = _pair(latents, reference)
    return float(np.mean((a - b) ** 2))
