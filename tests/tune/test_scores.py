"""``vllm_omni_mxfp4.tune.scores``: the sums the engine returns turned into scores."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_omni_mxfp4.tune.scores import (
    Measure,
    isolated_share,
    local_scores,
    outcome,
    predicted_gains,
    step_scores,
)
from vllm_omni_mxfp4.tune.select import Unit


def sums(out: np.ndarray, ref: np.ndarray) -> list[float]:
    """The four sums the engine keeps, computed here directly."""
    d = out - ref
    return [
        float((d * d).sum()),
        float((ref * ref).sum()),
        float((out * ref).sum()),
        float((out * out).sum()),
    ]


def test_measures_from_sums_equal_direct_computation():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(1000)
    out = ref + 0.1 * rng.standard_normal(1000)
    m = Measure()
    m.add(sums(out[:500], ref[:500]))
    m.add(sums(out[500:], ref[500:]))  # two calls add up to one over the whole
    rel = ((out - ref) ** 2).sum() / (ref**2).sum()
    assert m.rel == pytest.approx(rel)
    assert m.sqnr == pytest.approx(-10 * math.log10(rel))
    assert m.cosine == pytest.approx(out @ ref / np.linalg.norm(out) / np.linalg.norm(ref))
    assert Measure().rel == 0.0 and Measure().sqnr == math.inf


def test_local_and_step_rows():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal(64)
    a4, a8 = ref + 0.2 * rng.standard_normal(64), ref + 0.05 * rng.standard_normal(64)
    rows = [
        ["transformer/blocks.0.ffn.net_2", 0, "w4a4", *sums(a4, ref)],
        ["transformer/blocks.0.ffn.net_2", 1, "w4a4", *sums(a4, ref)],
        ["transformer/blocks.0.ffn.net_2", 0, "w4a8", *sums(a8, ref)],
    ]
    score = local_scores(rows)["transformer/blocks.0.ffn.net_2"]
    assert sorted(score.a4_steps) == [0, 1]
    assert score.a4.rel == pytest.approx(score.a4_steps[0].rel)
    assert score.a8_gain == pytest.approx(score.a4.rel - score.a8.rel) and score.a8_gain > 0
    steps = step_scores(
        [
            ["transformer", 0, "w4a4", *sums(a4, ref)],
            ["transformer", 0, "w4a8", *sums(a8, ref)],
            ["transformer_2", 1, "w4a4", *sums(a4, ref)],
        ]
    )
    assert [s.step for s in steps] == [0, 1]
    assert steps[0].gain > 0 and steps[1].gain == 0.0  # no W4A8 row: nothing to gain (DualScale)


def test_outcome_and_gain():
    rng = np.random.default_rng(2)
    ref_steps = [rng.standard_normal((4, 4)) for _ in range(3)]
    near = [s + 0.01 for s in ref_steps]
    far = [s + 0.1 for s in ref_steps]
    frames = rng.random((2, 8, 8, 3)).astype(np.float32)
    ref = outcome([frames], [ref_steps], [frames], [ref_steps])
    assert ref.final_mse == 0 and ref.psnr == math.inf and ref.latent_cosine == pytest.approx(1.0)
    a = outcome([frames], [near], [frames], [ref_steps])
    b = outcome([frames], [far], [frames], [ref_steps])
    assert a.final_mse == pytest.approx(1e-4) and b.final_mse == pytest.approx(1e-2)
    assert a.trajectory_mse == pytest.approx(1e-4) and b.trajectory_mse == pytest.approx(1e-2)
    assert isolated_share(a, b) == pytest.approx(0.01)
    assert len(a.trajectory) == 3 and a.latent_cosine > b.latent_cosine


def test_predicted_gains_scale_the_local_score_by_the_candidates():
    units = [Unit("t", f"blocks.{i}.x", "mxfp4", 32, 32, i, True) for i in range(3)]
    local = local_scores([[u.key, 0, "w4a4", rel, 1.0, 0.0, 0.0] for u, rel in zip(units, (0.4, 0.2, 0.1))])
    gains = predicted_gains(units, local, {units[0].key: 0.8, units[1].key: 0.2})
    assert gains[units[0].key] == 0.8 and gains[units[1].key] == 0.2  # measured
    # median of 0.8/0.4 = 2 and 0.2/0.2 = 1 is 1.5
    assert gains[units[2].key] == pytest.approx(1.5 * 0.1)
