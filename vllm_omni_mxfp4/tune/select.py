"""What tune chooses among and how: units, budgets, the selection by gain, the static priors, configs.

A *unit* is one runtime Linear of one component (``transformer/blocks.3.attn1.to_qkv``): a fused
module (``to_qkv``) is one unit, as the runtime runs it in one precision. Keeping a unit in BF16
costs its BF16 weight bytes instead of its packed ones; a budget limits the number of BF16 units
and/or their share of the quantized Linears' BF16 weight bytes, the number of W4A8 units and the
number of W4A8 steps. Pure Python: plans and configs are plain dicts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..spec import MX_BLOCK

DUALSCALE_BLOCK = 512


@dataclass(frozen=True)
class Unit:
    """One quantized runtime Linear, as the tuning engine reports it (full, unsharded N and K)."""

    component: str
    layer: str
    method: str
    n: int
    k: int
    block: int | None
    w4a8: bool

    @property
    def key(self) -> str:
        return f"{self.component}/{self.layer}"

    @property
    def bf16_bytes(self) -> int:
        return self.n * self.k * 2

    @property
    def packed_bytes(self) -> int:
        """The checkpoint bytes of the quantized weight: FP4 values, E8M0 scales (and the DualScale
        FP32 per-512 scales)."""
        size = self.n * self.k // 2 + self.n * math.ceil(self.k / MX_BLOCK)
        if self.method == "mxfp4_dualscale":
            size += 4 * self.n * math.ceil(self.k / DUALSCALE_BLOCK)
        return size

    @property
    def extra_bytes(self) -> int:
        """What keeping the unit in BF16 adds to the weights."""
        return self.bf16_bytes - self.packed_bytes


def units_from(report: Mapping[str, Any]) -> list[Unit]:
    """The units of a tuning engine's setup report, in model order."""
    return [
        Unit(u["component"], u["layer"], u["method"], u["n"], u["k"], u["block"], u["w4a8"])
        for u in report["units"]
    ]


@dataclass(frozen=True)
class Budget:
    """How much may stay in higher precision. ``bf16_layers`` and ``bf16_fraction`` (share of the
    quantized Linears' BF16 weight bytes) both apply when both are given."""

    bf16_layers: int | None = None
    bf16_fraction: float | None = None
    w4a8_layers: int = 0
    w4a8_steps: int = 0

    def __post_init__(self) -> None:
        if self.bf16_layers is not None and self.bf16_layers < 0:
            raise ValueError(f"--max-bf16-layers must be >= 0, got {self.bf16_layers}")
        if self.bf16_fraction is not None and not 0.0 <= self.bf16_fraction <= 1.0:
            raise ValueError(f"--max-bf16-fraction must be within [0, 1], got {self.bf16_fraction}")
        if self.w4a8_layers < 0 or self.w4a8_steps < 0:
            raise ValueError("--max-w4a8-layers and --max-w4a8-steps must be >= 0")

    def bf16_byte_limit(self, units: Sequence[Unit]) -> float:
        if self.bf16_fraction is None:
            return math.inf
        return self.bf16_fraction * sum(u.bf16_bytes for u in units)

    def fits(self, chosen: Sequence[Unit], units: Sequence[Unit]) -> bool:
        """Whether ``chosen`` (BF16 units) stays within the BF16 budget."""
        if self.bf16_layers is not None and len(chosen) > self.bf16_layers:
            return False
        return sum(u.bf16_bytes for u in chosen) <= self.bf16_byte_limit(units) + 1e-9

    def describe(self) -> str:
        parts = []
        if self.bf16_layers is not None:
            parts.append(f"<= {self.bf16_layers} BF16 Linears")
        if self.bf16_fraction is not None:
            parts.append(f"<= {self.bf16_fraction:.1%} of the quantized weights' BF16 bytes in BF16")
        if self.w4a8_layers:
            parts.append(f"<= {self.w4a8_layers} W4A8 Linears")
        if self.w4a8_steps:
            parts.append(f"<= {self.w4a8_steps} W4A8 steps")
        return ", ".join(parts) or "nothing in higher precision"


def fill(order: Sequence[Unit], budget: Budget, units: Sequence[Unit]) -> list[Unit]:
    """Units taken in ``order`` while they fit (a unit that does not fit is skipped, later smaller
    ones may still fit)."""
    chosen: list[Unit] = []
    for unit in order:
        if budget.fits([*chosen, unit], units):
            chosen.append(unit)
    return chosen


def select_by_gain(units: Sequence[Unit], gains: Mapping[str, float], budget: Budget) -> list[Unit]:
    """The BF16 units: with a layer budget alone, the ``bf16_layers`` largest positive gains (exact);
    with a byte budget, greedily by gain per extra byte. Units without a positive gain are never kept."""
    useful = [u for u in units if gains.get(u.key, 0.0) > 0.0]
    if budget.bf16_fraction is None:
        order = sorted(useful, key=lambda u: -gains[u.key])
    else:
        order = sorted(useful, key=lambda u: -gains[u.key] / max(u.extra_bytes, 1))
    return fill(order, budget, units)


def _blocks(units: Sequence[Unit]) -> list[int]:
    return sorted({u.block for u in units if u.block is not None})


def first_blocks_order(units: Sequence[Unit]) -> list[Unit]:
    """The first-N-blocks rule: block 0 of every component, then block 1, ... (model order inside)."""
    return sorted((u for u in units if u.block is not None), key=lambda u: u.block)


def edge_prior_order(units: Sequence[Unit]) -> list[Unit]:
    """ModelOpt's Wan filter as an order: every Linear outside the numbered blocks (embedders,
    ``proj_out``), then the first and the last block, the second and the second-to-last, ..."""
    blocks = _blocks(units)
    edges: list[int] = []
    lo, hi = 0, len(blocks) - 1
    while lo <= hi:
        edges.append(blocks[lo])
        if hi != lo:
            edges.append(blocks[hi])
        lo, hi = lo + 1, hi - 1
    rank = {b: i for i, b in enumerate(edges)}
    outside = [u for u in units if u.block is None]
    inside = sorted((u for u in units if u.block is not None), key=lambda u: rank[u.block])
    return outside + inside


def random_order(units: Sequence[Unit], seed: int) -> list[Unit]:
    order = list(units)
    random.Random(seed).shuffle(order)
    return order


def base_config(method: str) -> dict[str, Any]:
    """The config tune starts from: every Linear the method quantizes by default at W4A4. DualScale's
    leading-block default (``num_bf16_fallback_layers``, 5 blocks) is set to 0: tune chooses instead."""
    return {"method": method, **({"num_bf16_fallback_layers": 0} if method == "mxfp4_dualscale" else {})}


@dataclass(frozen=True)
class Selection:
    """A configuration: its BF16 units, W4A8 units, W4A8 steps (W4A4 everywhere else)."""

    label: str
    bf16: tuple[str, ...] = ()
    w4a8: tuple[str, ...] = ()
    a8_steps: tuple[int, ...] = ()
    kept: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Per component, the Linears the config already keeps in BF16 (a family default)."""

    def plan(self) -> dict[str, Any]:
        """The tuning engine's plan for this selection."""
        layers = {key: "bf16" for key in self.bf16}
        layers.update({key: "w4a8" for key in self.w4a8})
        return {"layers": layers, "default": "w4a4", "a8_steps": list(self.a8_steps), "scoring": False}

    def config(self, method: str, components: Sequence[str]) -> dict[str, Any]:
        """The quantization config that serves this selection: flat when every component gets the
        same lists, per component otherwise. ``ignored_layers`` also lists what the family default
        kept in BF16 (a list given in a config replaces that default)."""
        per = {}
        for component in components:
            ignored = sorted(
                {
                    *self.kept.get(component, ()),
                    *(k.split("/", 1)[1] for k in self.bf16 if k.startswith(f"{component}/")),
                }
            )
            w4a8 = sorted(k.split("/", 1)[1] for k in self.w4a8 if k.startswith(f"{component}/"))
            entry: dict[str, Any] = {**base_config(method), "ignored_layers": ignored}
            if method == "mxfp4":
                entry["w4a8_fallback_layers"] = w4a8
                entry["w4a8_fallback_steps"] = sorted(self.a8_steps)
            per[component] = entry
        values = list(per.values())
        if len(values) == 1 or all(v == values[0] for v in values):
            return values[0]
        return per


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long score lists (average ranks for ties)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("spearman needs two lists of the same length, at least 2")

    def ranks(values: Sequence[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for m in range(i, j + 1):
                out[order[m]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else 0.0
