"""The frame and latent measures of ``compare`` against closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_omni_mxfp4.compare import metrics


def test_ssim_of_flat_frames_is_the_luminance_term():
    """Without structure (zero variance, zero covariance) SSIM is (2ab + C1) / (a^2 + b^2 + C1)."""
    a, b = np.full((2, 16, 16, 3), 0.25), np.full((2, 16, 16, 3), 0.75)
    c1 = (0.01 * 1.0) ** 2
    want = (2 * 0.25 * 0.75 + c1) / (0.25**2 + 0.75**2 + c1)
    assert metrics.ssim(a, b) == pytest.approx(want, rel=1e-12)


def test_ssim_is_one_for_equal_frames_symmetric_and_lower_for_noise():
    rng = np.random.default_rng(0)
    frames = rng.random((3, 24, 24, 3))
    noisy = np.clip(frames + rng.normal(0, 0.1, frames.shape), 0, 1)
    assert metrics.ssim(frames, frames) == pytest.approx(1.0, abs=1e-12)
    assert metrics.ssim(frames, noisy) == pytest.approx(metrics.ssim(noisy, frames), rel=1e-12)
    # independent noise of variance s2 on a signal of variance v: SSIM ~ 2v / (2v + s2) = 0.943 here
    assert metrics.ssim(frames, noisy) == pytest.approx(2 / 12 / (2 / 12 + 0.01), abs=0.02)
    much = np.clip(frames + rng.normal(0, 0.3, frames.shape), 0, 1)
    assert metrics.ssim(frames, much) < metrics.ssim(frames, noisy)


def test_ssim_refuses_what_it_cannot_measure():
    with pytest.raises(ValueError, match="different shapes"):
        metrics.ssim(np.zeros((8, 8, 3)), np.zeros((8, 9, 3)))
    with pytest.raises(ValueError, match=r"\(\.\.\., H, W, C\)"):
        metrics.ssim(np.zeros((8, 8)), np.zeros((8, 8)))
    assert math.isnan(metrics.ssim(np.full((8, 8, 3), np.nan), np.zeros((8, 8, 3))))


def test_latent_cosine_and_mse():
    a = np.array([[3.0, 4.0]])
    assert metrics.latent_cosine(a, a) == pytest.approx(1.0)
    assert metrics.latent_cosine(a, np.array([[4.0, -3.0]])) == pytest.approx(0.0)
    assert metrics.latent_cosine(a, -a) == pytest.approx(-1.0)
    assert math.isnan(metrics.latent_cosine(a, np.zeros_like(a)))
    assert metrics.mse(a, np.array([[1.0, 1.0]])) == pytest.approx((4 + 9) / 2)
