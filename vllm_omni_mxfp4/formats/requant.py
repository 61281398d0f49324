"""NVFP4 -> MXFP4 requantization, one 32-element block at a time, with a per-layer error report.

An NVFP4 weight (:mod:`.nvfp4`) is dequantized exactly to float32 (``order="exact"``) and each
32-element block of a row (two adjacent NVFP4 16-blocks) gets one E8M0 exponent and E2M1 codes. The
result is laid out exactly as :func:`~.mx.quantize_mx` lays it out: packed uint8 ``(N, K/2)``, even
element in the low nibble, and uint8 E8M0 codes ``(N, ceil(K/32))``, so every MXFP4 Linear method
runs it unchanged. The exponent rule is selectable:

- ``floor``, ``even``, ``rceil``: the vendor rules of :mod:`.scale_rules`, by calling
  :func:`~.mx.quantize_mx` on the float32 dequant (``even`` is what SGLang's requantization uses);
- ``mse``: per block, among the exponents ``e0 - 1, e0, e0 + 1`` (``e0`` = the ``floor`` code,
  clamped to 0..254) the one whose quantize-dequantize has the least squared error against the
  float32 block. The set holds every code ``floor``, ``even`` and ``rceil`` can give (they are
  ``e0`` or ``e0 + 1``), so ``mse`` is never worse than any of them on any block. Ties go to
  ``e0`` when it is among the best (so a block ``floor`` reproduces exactly keeps ``floor``'s
  bytes, and lossless round trips give back the original MXFP4 bytes), otherwise to the larger
  exponent (less saturation).

Rows are processed in chunks (:func:`~.nvfp4.row_slices`): the extra memory of a whole layer is
the packed result plus one chunk of float32 temporaries, far below one layer in float32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from vllm_omni_mxfp4 import spec

from .e2m1 import e2m1_decode, e2m1_encode, pack_fp4
from .mx import dequantize_mx, quantize_mx
from .nvfp4 import Nvfp4Weight, dequantize_rows, row_slices
from .scale_rules import shared_exponent_codes

REQUANT_RULES = ("floor", "even", "rceil", "mse")
"""The exponent rules :func:`requantize_nvfp4` accepts."""

MX_BLOCK = spec.MX_BLOCK


@dataclass(frozen=True)
class RequantError:
    """How far a layer's MXFP4 result is from its float32 NVFP4 dequant.

    ``rel_rms`` = ||mx - ref|| / ||ref|| over the whole layer (0 for an all-zero layer),
    ``max_abs`` = max |mx - ref|, ``exact_blocks`` / ``total_blocks`` = 32-blocks reproduced
    exactly (zeros compared without sign).
    """

    name: str
    rule: str
    rel_rms: float
    max_abs: float
    exact_blocks: int
    total_blocks: int

    def __str__(self) -> str:
        share = self.exact_blocks / self.total_blocks if self.total_blocks else 1.0
        return (
            f"{self.name}: rule={self.rule} rel_rms={self.rel_rms:.4g} max_abs={self.max_abs:.4g} "
            f"exact_blocks={self.exact_blocks}/{self.total_blocks} ({share:.1%})"
        )


@dataclass(frozen=True)
class Requantized:
    """MXFP4 result of one layer: ``data`` uint8 (N, K/2), ``scale`` uint8 E8M0 (N, ceil(K/32))."""

    data: torch.Tensor
    scale: torch.Tensor
    error: RequantError


class _ErrorSums:
    """Running sums of the error report over row chunks (squares summed in float64)."""

    def __init__(self) -> None:
        self.err2 = 0.0
        self.ref2 = 0.0
        self.max_abs = 0.0
        self.exact = 0
        self.blocks = 0

    def add(self, ref: torch.Tensor, ref2: float, data: torch.Tensor, scale: torch.Tensor) -> None:
        """Compare one chunk's MXFP4 result ``(data, scale)`` with its float32 reference ``ref``
        (whose float64 sum of squares is ``ref2``)."""
        diff = dequantize_mx(data, scale).sub_(ref)
        self.err2 += float(diff.double().square_().sum())
        self.ref2 += ref2
        self.max_abs = max(self.max_abs, float(diff.abs().max()))
        exact = _blocks(diff == 0, scale.shape[-1]).all(dim=-1)
        self.exact += int(exact.sum())
        self.blocks += exact.numel()

    def report(self, name: str, rule: str) -> RequantError:
        rel = math.sqrt(self.err2 / self.ref2) if self.ref2 else math.sqrt(self.err2)
        return RequantError(name, rule, rel, self.max_abs, self.exact, self.blocks)


def _blocks(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(R, K)`` -> ``(R, groups, 32)``, zero-padding (or False-padding) a partial last block."""
    pad = groups * MX_BLOCK - x.shape[-1]
    if pad:
        fill = True if x.dtype == torch.bool else 0
        x = torch.nn.functional.pad(x, (0, pad), value=fill)
    return x.reshape(x.shape[0], groups, MX_BLOCK)


def _candidates(blocks: torch.Tensor) -> torch.Tensor:
    """int32 ``(R, G, 3)`` candidate E8M0 codes ``e0 - 1, e0, e0 + 1`` (clamped), ``e0`` the floor code."""
    e0 = shared_exponent_codes(blocks.abs().amax(dim=-1), "floor")
    return torch.stack((e0 - 1, e0, e0 + 1), dim=-1).clamp_(0, 254)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """float32 ``2 ** exponent`` for int32 exponents in [-127, 127], exact (subnormal 2^-127 included)."""
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)


@functools.cache
def _encode_table(device: torch.device) -> torch.Tensor:
    """uint8 ``(65536,)``: :func:`~.e2m1.e2m1_encode` of every bfloat16 bit pattern."""
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(torch.bfloat16)
    return e2m1_encode(patterns.float()).to(device)


@functools.cache
def _decode_table(device: torch.device) -> torch.Tensor:
    """float32 ``(16,)``: :func:`~.e2m1.e2m1_decode` of every E2M1 code."""
    return e2m1_decode(torch.arange(16, dtype=torch.uint8)).to(device)


def _lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for an integer index tensor of any shape (one flat ``index_select``)."""
    return table.index_select(0, index.reshape(-1).to(torch.int32)).reshape(index.shape)


def encode_e2m1(y: torch.Tensor) -> torch.Tensor:
    """:func:`~.e2m1.e2m1_encode` of finite float32 ``y``, through a table of the bf16 patterns.

    The top 16 bits of a float32 are its bf16 truncation; OR-ing the 16 dropped bits into the last
    kept bit (a sticky bit) keeps every E2M1 rounding decision (thresholds have at most three
    mantissa bits) as the full value would, so one table lookup replaces the threshold compares.
    The requantizer encodes three candidates per block, hence the fast path.
    """
    bits = y.view(torch.int32)
    index = ((bits >> 16) & 0xFFFF) | ((bits & 0xFFFF) != 0).to(torch.int32)
    return _lookup(_encode_table(y.device), index)


def _pick(sse: torch.Tensor) -> torch.Tensor:
    """Index (0..2) of the best candidate per block: ``e0`` (1) on a tie, else the larger exponent."""
    best = sse.amin(dim=-1)
    pick = torch.where(sse[..., 2] == best, 2, 0)
    return torch.where(sse[..., 1] == best, 1, pick)


def _mse_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``mse`` rule on float32 ``(R, G, 32)`` blocks: (E2M1 codes ``(R, G, 32)``, E8M0 codes ``(R, G)``).

    The squared errors are summed in float64 from exact float32 differences, so near-ties are
    decided as a float64 reference would.
    """
    cands = _candidates(blocks)
    decode = _decode_table(blocks.device)
    codes, sse = [], []
    for j in range(cands.shape[-1]):
        c = cands[..., j : j + 1]
        q = encode_e2m1(blocks * _pow2(127 - c))
        err = _lookup(decode, q).mul_(_pow2(c - 127)).sub_(blocks)
        codes.append(q)
        sse.append(err.double().square_().sum(dim=-1))
    pick = _pick(torch.stack(sse, dim=-1))
    q = torch.stack(codes, dim=-2).gather(-2, pick[..., None, None].expand(*pick.shape, 1, MX_BLOCK))
    return q.squeeze(-2), cands.gather(-1, pick.unsqueeze(-1)).squeeze(-1)


def quantize_mx_mse(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of float32 rows ``x`` ``(R, K)`` (K even) under the ``mse`` rule, laid out as ``quantize_mx``."""
    r, k = x.shape
    groups = spec.ceil_div(k, MX_BLOCK)
    q, scale = _mse_blocks(_blocks(x, groups))
    return pack_fp4(q.reshape(r, groups * MX_BLOCK)[:, :k]), scale.to(torch.uint8)


def _square_sum(ref: torch.Tensor, w: Nvfp4Weight, rows: slice) -> float:
    """float64 sum of squares of a dequantized chunk; refuses NaN / Inf (an E4M3 NaN block scale),
    which MXFP4 would turn into a NaN block, naming the layer and the first bad row."""
    total = float(ref.double().square_().sum())
    if not math.isfinite(total):
        row = rows.start + int((~torch.isfinite(ref)).any(dim=-1).nonzero()[0])
        raise ValueError(
            f"{w.name}: the NVFP4 weight dequantizes to NaN/Inf in row {row} (an E4M3 NaN block scale); "
            "the checkpoint is corrupt; re-export it or keep this layer unquantized"
        )
    return total


def requantize_nvfp4(w: Nvfp4Weight, rule: str = "mse") -> Requantized:
    """Requantize an NVFP4 weight to MXFP4 under ``rule`` (module docstring), with its error report."""
    if rule not in REQUANT_RULES:
        raise ValueError(f"rule must be one of {list(REQUANT_RULES)}, got {rule!r}")
    n, k = w.shape
    data = torch.empty((n, k // 2), dtype=torch.uint8, device=w.codes.device)
    scale = torch.empty((n, spec.ceil_div(k, MX_BLOCK)), dtype=torch.uint8, device=w.codes.device)
    sums = _ErrorSums()
    for rows in row_slices(n, k):
        ref = dequantize_rows(w, rows, "exact")
        ref2 = _square_sum(ref, w, rows)
        if rule == "mse":
            data[rows], scale[rows] = quantize_mx_mse(ref)
        else:
            data[rows], scale[rows] = quantize_mx(ref, scale_rule=rule)
        sums.add(ref, ref2, data[rows], scale[rows])
    return Requantized(data, scale, sums.report(w.name, rule))
