"""Scores from the tuning engine's sums and from whole generations.

- **Local** (per unit): over every call of the scoring pass, the Linear's W4A4 (and W4A8) output on
  the BF16 model's own activations against its BF16 output: relative error (error energy over
  output energy, the inverse of the SQNR), SQNR in dB and cosine; also per step.
- **Step** (per denoising step): the transformer's prediction with every Linear at W4A4, and at W4A8,
  against the BF16 prediction on the same input; a step's gain is the relative error W4A8 removes.
- **End to end** (per candidate unit): one generation per tuning request with that unit alone in
  W4A4 (everything else BF16); its gain is the trajectory error it causes alone (latent MSE against
  BF16, averaged over the steps) as a share of the all-W4A4 trajectory's, which is what keeping it
  in BF16 removes to first order. Measured the other way round (the unit alone in BF16, the gain a
  small difference of two large, chaotic errors), the candidates' ranks agreed between two halves
  of the requests with Spearman 0.25-0.37 on the trained tiny Wan2.2; alone in W4A4, 0.80-0.90
  (docs/tuning.md). The final output's PSNR and the mean latent cosine are kept beside it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..compare import metrics
from .select import Unit


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _db(rel: float) -> float:
    return math.inf if rel == 0 else -10.0 * math.log10(rel) if math.isfinite(rel) else -math.inf


@dataclass
class Measure:
    """Summed error against BF16: relative error, SQNR and cosine derive from it."""

    err: float = 0.0
    ref: float = 0.0
    dot: float = 0.0
    out: float = 0.0

    def add(self, sums: Sequence[float]) -> None:
        self.err += sums[0]
        self.ref += sums[1]
        self.dot += sums[2]
        self.out += sums[3]

    @property
    def rel(self) -> float:
        return _ratio(self.err, self.ref)

    @property
    def sqnr(self) -> float:
        return _db(self.rel)

    @property
    def cosine(self) -> float:
        den = math.sqrt(self.ref * self.out)
        return self.dot / den if den > 0 else math.nan


@dataclass
class LocalScore:
    """One unit's local scores: all steps together, and per step."""

    a4: Measure = field(default_factory=Measure)
    a8: Measure = field(default_factory=Measure)
    a4_steps: dict[int, Measure] = field(default_factory=lambda: defaultdict(Measure))

    @property
    def a8_gain(self) -> float:
        """The relative error W4A8 removes from this Linear's output (0 without W4A8)."""
        return max(self.a4.rel - self.a8.rel, 0.0) if self.a8.ref > 0 else 0.0


def local_scores(rows: Sequence[Sequence[Any]]) -> dict[str, LocalScore]:
    """The engine's ``local`` rows ``[key, step, precision, err, ref, dot, out]`` by unit key."""
    scores: dict[str, LocalScore] = defaultdict(LocalScore)
    for key, step, precision, *sums in rows:
        score = scores[key]
        if precision == "w4a4":
            score.a4.add(sums)
            score.a4_steps[int(step)].add(sums)
        elif precision == "w4a8":
            score.a8.add(sums)
    return dict(scores)


@dataclass
class StepScore:
    """One denoising step: the transformer prediction's error at W4A4 and at W4A8 against BF16."""

    step: int
    a4: Measure = field(default_factory=Measure)
    a8: Measure = field(default_factory=Measure)
    components: set[str] = field(default_factory=set)

    @property
    def gain(self) -> float:
        return max(self.a4.rel - self.a8.rel, 0.0) if self.a8.ref > 0 else 0.0


def step_scores(rows: Sequence[Sequence[Any]]) -> list[StepScore]:
    """The engine's ``steps`` rows ``[component, step, precision, err, ref, dot, out]`` per step."""
    steps: dict[int, StepScore] = {}
    for component, step, precision, *sums in rows:
        score = steps.setdefault(int(step), StepScore(int(step)))
        score.components.add(component)
        (score.a4 if precision == "w4a4" else score.a8).add(sums)
    return [steps[s] for s in sorted(steps)]


@dataclass
class Outcome:
    """One configuration's generations against the BF16 reference's, over the tuning requests."""

    final_mse: float
    psnr: float
    latent_cosine: float
    trajectory: list[float]
    trajectory_mse: float = math.nan
    """The latents' MSE against the reference's, averaged over the steps and the requests."""


def outcome(
    frames: Sequence[np.ndarray],
    trajectories: Sequence[Sequence[np.ndarray]],
    ref_frames: Sequence[np.ndarray],
    ref_trajectories: Sequence[Sequence[np.ndarray]],
) -> Outcome:
    """Mean final-latent MSE, final-output PSNR and per-step latent cosine against the reference."""
    finals, psnrs, curves, mses = [], [], [], []
    for out, steps, ref_out, ref_steps in zip(frames, trajectories, ref_frames, ref_trajectories):
        psnrs.append(metrics.psnr(out, ref_out))
        pairs = list(zip(steps, ref_steps))
        if pairs:
            finals.append(metrics.mse(*pairs[-1]))
            curves.append([metrics.latent_cosine(a, b) for a, b in pairs])
            mses.append(float(np.mean([metrics.mse(a, b) for a, b in pairs])))
        else:  # no step recorded: the final output stands in for the latents
            finals.append(
                float(np.mean((np.asarray(out, np.float64) - np.asarray(ref_out, np.float64)) ** 2))
            )
    n = min((len(c) for c in curves), default=0)
    trajectory = [float(np.mean([c[i] for c in curves])) for i in range(n)]
    finite = [p for p in psnrs if math.isfinite(p)]
    psnr = float(np.mean(finite)) if finite else math.inf  # inf only where every output equals BF16's
    return Outcome(
        float(np.mean(finals)),
        psnr,
        float(np.mean(trajectory)) if trajectory else math.nan,
        trajectory,
        float(np.mean(mses)) if mses else float(np.mean(finals)),
    )


def isolated_share(alone: Outcome, baseline: Outcome) -> float:
    """The trajectory error one Linear causes alone (it W4A4, everything else BF16), as a share of
    the all-W4A4 trajectory's: what keeping it in BF16 removes, to first order."""
    return _ratio(alone.trajectory_mse, baseline.trajectory_mse)


def predicted_gains(
    units: Sequence[Unit], local: Mapping[str, LocalScore], measured: Mapping[str, float]
) -> dict[str, float]:
    """A gain for every unit: the measured end-to-end gain where there is one, otherwise the local
    relative error scaled by the median ratio of measured gain to local error among the candidates."""
    ratios = [
        measured[k] / local[k].a4.rel
        for k in measured
        if k in local and local[k].a4.rel > 0 and measured[k] > 0
    ]
    scale = float(np.median(ratios)) if ratios else 0.0
    gains = {}
    for unit in units:
        if unit.key in measured:
            gains[unit.key] = measured[unit.key]
        elif unit.key in local:
            gains[unit.key] = scale * local[unit.key].a4.rel
    return gains
