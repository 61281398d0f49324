"""The per-Linear MXFP4 statistics of docs/quality.md, on inputs whose answers are known."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_omni_mxfp4_tiny import linear_stats


def test_kurtosis_and_crest_of_known_distributions():
    g = torch.Generator().manual_seed(0)
    gaussian = torch.randn(256, 1024, generator=g)
    uniform = torch.rand(256, 1024, generator=g) * 2 - 1
    assert linear_stats._kurtosis(gaussian) == pytest.approx(3.0, abs=0.05)
    assert linear_stats._kurtosis(uniform) == pytest.approx(1.8, abs=0.02)
    # a block of 31 zeros and one 1: max / RMS = sqrt(32); constant blocks: 1
    spike = torch.zeros(4, 64)
    spike[:, 0] = 1.0
    spike[:, 32:] = 3.0
    assert linear_stats._block_crest(spike) == pytest.approx((math.sqrt(32) + 1) / 2)
    channels = torch.ones(8, 4)
    channels[:, 3] = 10.0
    assert linear_stats._channel_ratio(channels) == pytest.approx(10.0)


def test_values_on_the_mxfp4_grid_have_no_quantization_error_and_others_do():
    g = torch.Generator().manual_seed(1)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    # every 32-block holds a 6 (its max), so the OCP scale is 1 and every value is representable
    exact_w = grid[torch.randint(8, (16, 64), generator=g)] * torch.where(
        torch.rand(16, 64, generator=g) < 0.5, -1, 1
    )
    exact_w[:, ::32] = 6.0
    exact_x = grid[torch.randint(8, (10, 64), generator=g)]
    exact_x[:, ::32] = 6.0
    stats = linear_stats._measure("blocks.0.attn1.to_q", exact_w, exact_x)
    assert stats.weight_rel_error == 0.0 and stats.output_sqnr_db > 200
    assert (stats.n, stats.k) == (16, 64)
    noisy = linear_stats._measure(
        "blocks.0.attn1.to_q", torch.randn(16, 64, generator=g), torch.randn(10, 64, generator=g)
    )
    assert 0.05 < noisy.weight_rel_error < 0.3 and 5 < noisy.output_sqnr_db < 30


def test_summary_takes_medians_per_linear_kind():
    def stats(name: str, value: float) -> linear_stats.LinearStats:
        return linear_stats.LinearStats(name, 4, 32, value, value, value, value, value, value, value)

    summary = linear_stats.summarize(
        [stats("transformer.blocks.0.attn1.to_q", 1.0), stats("transformer.blocks.1.attn1.to_q", 3.0)]
        + [stats("transformer_2.blocks.0.ffn.net.2", 10.0), stats("transformer_2.proj_out", 7.0)]
    )
    assert set(summary) == {"blocks", "attn1.to_q", "ffn.net.2", "proj_out"}
    assert summary["attn1.to_q"]["output_sqnr_db"] == 2.0 and summary["blocks"]["weight_kurtosis"] == 3.0
    assert summary["proj_out"]["weight_kurtosis"] == 7.0
