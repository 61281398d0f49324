"""NVFP4 -> MXFP4 requantization, one 32-element block at a time, with a per-layer error report.

The result is defined on the exact float32 dequant of the NVFP4 weight (:func:`~.nvfp4.dequantize_nvfp4`,
``order="exact"``): each 32-element block of a row (two adjacent NVFP4 16-blocks) gets one E8M0
exponent and RNE E2M1 codes, laid out exactly as :func:`~.mx.quantize_mx` lays them out (packed
uint8 ``(N, K/2)``, even element in the low nibble; uint8 E8M0 ``(N, ceil(K/32))``; a partial last
block zero-padded; under ``floor`` a code-0 block is zeroed), so every MXFP4 Linear method runs it
unchanged. The exponent rule is selectable:

- ``floor``, ``even``, ``rceil``: the vendor rules of :mod:`.scale_rules` applied to the block
  maximum (``even`` is what SGLang's requantization uses);
- ``mse``: per block, among the exponents ``e0 - 1, e0, e0 + 1`` (``e0`` = the ``floor`` code,
  clamped to 0..254) the one whose quantize-dequantize has the least squared error against the
  float32 block. The set holds every code ``floor``, ``even`` and ``rceil`` can give (``e0`` or
  ``e0 + 1``), so ``mse`` is never worse than any of them on any block. Ties go to ``e0`` when it
  is among the best (a block ``floor`` reproduces exactly keeps ``floor``'s bytes, so lossless
  round trips give back the original MXFP4 bytes), otherwise to the larger exponent.

How, without a float32 copy of the layer: an element's result depends only on its 4-bit code, its
E4M3 scale byte, the global scale and the block exponent, and within a 16-element half the
exponent matters only through its offset ``d`` from the half's own natural exponent, which can
only take a few values (:data:`SHIFTS`). So one set of tables per global-scale value, built with
the exact dequant and :func:`~.e2m1.e2m1_encode` themselves, maps ``(scale byte, d, input byte)`` to
the output byte, its squared error and its largest error; requantizing a layer is then table
gathers over its bytes, in row chunks. The tests check the result against an independent float64
reference and against ``quantize_mx`` of the float32 dequant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_omni_mxfp4 import spec

from .e2m1 import e2m1_decode, e2m1_encode, pack_fp4
from .nvfp4 import Nvfp4Weight, dequantize_nvfp4, row_slices
from .scale_rules import e8m0_to_float, shared_exponent_codes

REQUANT_RULES = spec.REQUANT_RULES
"""The exponent rules :func:`requantize_nvfp4` accepts (the one list in :mod:`vllm_omni_mxfp4.spec`)."""

MX_BLOCK = spec.MX_BLOCK
HALF = spec.NVFP4_BLOCK
SHIFTS = tuple(range(-6, 8))
"""Offsets ``d`` = block exponent - the half's natural exponent (the ``floor`` code of 6 * s * g).
A block exponent is at least ``floor(amax) - 1`` and a nonzero half's amax is at least 1/12 of its
6 * s * g, so ``d >= -5``; the half's elements are below 2^(3 - d) times the block scale, so from
``d = 5`` on all of them round to +-0: larger offsets are looked up at ``d = 5``, and the slots up
to ``d = 7`` let ``mse`` reach its two upper candidates by adding one or two slots."""
TOP = SHIFTS.index(5)
SLOTS = len(SHIFTS) + 1
ZEROED = len(SHIFTS)
"""The last slot: FLOOR's zeroed blocks (code 0)."""


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


# ------------------------------------------------------------------------------------ tables


@dataclass(frozen=True)
class _Tables:
    """Lookup tables for one global scale (see the module docstring).

    ``half_codes`` (256 scale bytes * 8): the E8M0 code of the rule (``floor`` for ``mse``) of a
    16-half whose largest magnitude code is that one; every rule's code grows with the block
    maximum, so a block's code is the larger of its halves' (no float maximum, no rule per block).
    ``natural``
    (256,): the half's natural exponent; ``out`` / ``sse`` / ``max_err`` (256, slots, 256 bytes):
    output byte, float64 squared error and float32 largest |error| of a byte; ``ref2`` (256, 256):
    float64 sum of squares of a byte's two values; ``out_of_range`` (256,): scale bytes whose
    6 * s * g is nonzero but below 2^-124 or at least 2^123, where a slot's code would leave
    0..254 and the tables do not hold.
    """

    half_codes: torch.Tensor
    natural: torch.Tensor
    out: torch.Tensor
    sse: torch.Tensor
    max_err: torch.Tensor
    ref2: torch.Tensor
    out_of_range: torch.Tensor


def _element_tables(values: torch.Tensor, natural: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 codes and float32 errors ``(256, slots, 16)`` of every (scale byte, slot, code)."""
    shift = torch.tensor(SHIFTS, dtype=torch.int32)
    code = (natural.unsqueeze(1) + shift).clamp(0, 254).unsqueeze(-1)  # (256, shifts, 1)
    x = values.unsqueeze(1)  # (256, 1, 16)
    q = e2m1_encode(x * e8m0_to_float(254 - code))  # x * 2^(127 - code), exact
    err = e2m1_decode(q) * e8m0_to_float(code) - x
    q_zero = e2m1_encode(x * 0.0)  # FLOOR's code 0 zeroes the block, keeping each sign
    return torch.cat((q, q_zero), dim=1), torch.cat((err, -x), dim=1)


def _bytes(low: torch.Tensor, high: torch.Tensor, op) -> torch.Tensor:
    """``(..., 16)`` per-code tables combined into ``(..., 256)`` per-byte ones:
    ``op(low[byte & 15], high[byte >> 4])`` (broadcast, so no gathers)."""
    return op(low.unsqueeze(-2), high.unsqueeze(-1)).flatten(-2)


def _tables(g: float, divides: bool, device: torch.device, rule: str) -> _Tables:
    """The tables of global scale ``g`` (a multiplier, or a divisor with ``divides``), built with the
    exact dequant of every (scale byte, code) pair. About 13 MB, built per call in a few
    milliseconds and not cached: every layer has its own global scale."""
    codes = pack_fp4(torch.arange(16, dtype=torch.uint8).expand(256, 16))
    scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1).view(torch.float8_e4m3fn)
    values = dequantize_nvfp4(Nvfp4Weight(codes, scales, torch.tensor(g, dtype=torch.float32), divides))
    values = torch.nan_to_num(values)  # NaN scale bytes: refused before any lookup
    natural = shared_exponent_codes(values[:, 7].abs(), "floor")
    q, err = _element_tables(values, natural)
    e2, a, v2 = err.double().square(), err.abs(), values.double().square()
    out = _bytes(q, q << 4, torch.bitwise_or)
    sse, max_err, ref2 = _bytes(e2, e2, torch.add), _bytes(a, a, torch.maximum), _bytes(v2, v2, torch.add)
    out_of_range = ((natural == 0) & (values[:, 7] != 0)) | (natural > 254 - SHIFTS[-1])
    half_codes = shared_exponent_codes(values[:, :8].abs().flatten(), "floor" if rule == "mse" else rule)
    tables = (half_codes, natural, out, sse, max_err, ref2, out_of_range)
    return _Tables(*(t.to(device) for t in tables))


# ---------------------------------------------------------------------------- one row chunk


def _gather(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table.flatten()[index]`` for an int32 index tensor of any shape (half the index traffic of
    int64; every table has fewer than 2^31 entries)."""
    return table.reshape(-1).index_select(0, index.reshape(-1)).reshape(index.shape)


def _block_codes(t: _Tables, data: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """int32 ``(R, G)`` codes of the tables' rule from bytes ``(R, 2G, 8)`` (uint8) and scale bytes
    ``(R, 2G)``: the larger of each block's two halves' codes (see :class:`_Tables`)."""
    mag = torch.maximum(data & 7, (data >> 4) & 7).amax(dim=-1)  # each half's largest magnitude code
    return _gather(t.half_codes, s * 8 + mag.int()).reshape(s.shape[0], -1, 2).amax(dim=-1)


def _slot_index(t: _Tables, s: torch.Tensor, data: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """int32 flat table index ``(R, 2G, 8)`` of every byte for block codes ``code`` ``(R, G)``."""
    d = code.repeat_interleave(2, dim=1) - _gather(t.natural, s)
    slot = (d - SHIFTS[0]).clamp_(0, TOP)
    return ((s * SLOTS + slot) * 256).unsqueeze(-1) + data


def _block_sse(t: _Tables, index: torch.Tensor) -> torch.Tensor:
    """float64 ``(R, G)`` squared error of each block for the byte indices ``index`` ``(R, 2G, 8)``."""
    return _gather(t.sse, index).reshape(index.shape[0], -1, MX_BLOCK // 2).sum(dim=-1)


def _mse_codes(t: _Tables, s: torch.Tensor, data: torch.Tensor, e0: torch.Tensor):
    """The ``mse`` rule: int32 codes ``(R, G)``, their byte indices and block errors (float64).

    The candidates e0 - 1, e0, e0 + 1 are consecutive table slots, so one index serves all three;
    e0 - 1 does not exist for e0 = 0.
    """
    low = _slot_index(t, s, data, e0 - 1)
    sse = torch.stack([_block_sse(t, low + 256 * j if j else low) for j in range(3)], dim=-1)
    sse[..., 0].masked_fill_(e0 == 0, math.inf)
    best = sse.amin(dim=-1)
    pick = torch.where(sse[..., 1] == best, 1, torch.where(sse[..., 2] == best, 2, 0))
    index = low + 256 * pick.int().repeat_interleave(2, dim=1).unsqueeze(-1)
    return e0 - 1 + pick.int(), index, sse.gather(-1, pick.unsqueeze(-1)).squeeze(-1)


class _ErrorSums:
    """Running sums of the error report over row chunks (squares summed in float64)."""

    def __init__(self) -> None:
        self.err2 = self.ref2 = self.max_abs = 0.0
        self.exact = self.blocks = 0

    def add(self, t: _Tables, index: torch.Tensor, s: torch.Tensor, data: torch.Tensor, sse=None) -> None:
        """Add a chunk whose bytes were requantized through the table indices ``index`` (``sse``:
        the block errors when the caller has them already)."""
        sse = _block_sse(t, index) if sse is None else sse
        self.err2 += float(sse.sum())
        self.ref2 += float(_gather(t.ref2, (s * 256).unsqueeze(-1) + data).sum())
        self.max_abs = max(self.max_abs, float(_gather(t.max_err, index).max()))
        self.exact += int((sse == 0).sum())
        self.blocks += sse.numel()

    def report(self, name: str, rule: str) -> RequantError:
        rel = math.sqrt(self.err2 / self.ref2) if self.ref2 else math.sqrt(self.err2)
        return RequantError(name, rule, rel, self.max_abs, self.exact, self.blocks)


def _requant_chunk(t: _Tables, codes: torch.Tensor, scales: torch.Tensor, rule: str, sums: _ErrorSums):
    """MXFP4 ``(data (R, K/2), scale (R, G))`` of NVFP4 rows ``codes`` / scale bytes ``scales``."""
    r, half_k = codes.shape
    groups = spec.ceil_div(half_k * 2, MX_BLOCK)
    pad = groups * MX_BLOCK // 2 - half_k
    s = scales.int()
    if pad:  # a partial last MX block: one more half of zero codes with scale byte 0
        codes, s = torch.nn.functional.pad(codes, (0, pad)), torch.nn.functional.pad(s, (0, 1))
    codes = codes.reshape(r, 2 * groups, HALF // 2)
    code = _block_codes(t, codes, s)
    data = codes.int()
    if rule == "mse":
        code, index, sse = _mse_codes(t, s, data, code)
    else:
        index, sse = _slot_index(t, s, data, code), None
    if rule == "floor" and bool((code == 0).any()):  # quantize_mx's FLOOR: code 0 zeroes the block
        zeroed = ((s * SLOTS + ZEROED) * 256).unsqueeze(-1) + data
        index = torch.where((code == 0).repeat_interleave(2, dim=1).unsqueeze(-1), zeroed, index)
    sums.add(t, index, s, data, sse)
    return _gather(t.out, index).reshape(r, -1)[:, :half_k], code.to(torch.uint8)


# ------------------------------------------------------------------------------------ public


def _check_scales(w: Nvfp4Weight) -> None:
    """Refuse E4M3 NaN block scales (0x7F / 0xFF): MXFP4 would turn them into a NaN block."""
    nan = (w.scales.view(torch.uint8) & 0x7F) == 0x7F
    if bool(nan.any()):
        row = int(nan.any(dim=-1).nonzero()[0])
        raise ValueError(
            f"{w.name}: NaN block scale in row {row} (E4M3 0x7F/0xFF); the checkpoint is corrupt; "
            "re-export it or keep this layer unquantized"
        )


def _row_groups(w: Nvfp4Weight) -> list[tuple[float, torch.Tensor | None]]:
    """(global scale, rows having it) pairs; ``None`` rows = all rows (a per-tensor scale)."""
    if w.global_scale.dim() == 0:
        return [(float(w.global_scale), None)]
    values, inverse = torch.unique(w.global_scale, return_inverse=True)
    return [(float(v), (inverse == i).nonzero().squeeze(1)) for i, v in enumerate(values.tolist())]


def requantize_nvfp4(w: Nvfp4Weight, rule: str = "mse") -> Requantized:
    """Requantize an NVFP4 weight to MXFP4 under ``rule`` (module docstring), with its error report."""
    if rule not in REQUANT_RULES:
        raise ValueError(f"rule must be one of {list(REQUANT_RULES)}, got {rule!r}")
    _check_scales(w)
    n, k = w.shape
    data = torch.empty((n, k // 2), dtype=torch.uint8, device=w.codes.device)
    scale = torch.empty((n, spec.ceil_div(k, MX_BLOCK)), dtype=torch.uint8, device=w.codes.device)
    sums = _ErrorSums()
    scale_bytes = w.scales.view(torch.uint8)
    for g, rows in _row_groups(w):
        t = _tables(g, w.global_divides, w.codes.device, rule)
        codes = w.codes if rows is None else w.codes.index_select(0, rows)
        sbytes = scale_bytes if rows is None else scale_bytes.index_select(0, rows)
        if bool(_gather(t.out_of_range, sbytes.long()).any()):
            raise ValueError(
                f"{w.name}: 6 x block scale x global scale outside [2^-124, 2^123) (weights near the "
                "float32 limits) cannot be requantized; keep this layer unquantized"
            )
        for chunk in row_slices(codes.shape[0], k):
            out, code = _requant_chunk(t, codes[chunk], sbytes[chunk], rule, sums)
            target = chunk if rows is None else rows[chunk]
            data[target], scale[target] = out, code
    return Requantized(data, scale, sums.report(w.name, rule))
