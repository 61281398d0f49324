"""NVFP4 -> MXFP4 requantization, defined block by block: the readable ground truth.

The result is defined on the exact float32 dequant of the NVFP4 weight
(:func:`~.nvfp4.dequantize_nvfp4`, ``order="exact"``): each 32-element block of a row (two adjacent
NVFP4 16-blocks) gets one E8M0 exponent and round-to-nearest-even E2M1 codes, laid out exactly as
:func:`~.mx.quantize_mx` lays them out (packed uint8 ``(N, K/2)``, even element in the low nibble;
uint8 E8M0 ``(N, ceil(K/32))``; a partial last block zero-padded; under ``floor`` a code-0 block is
zeroed), so every MXFP4 Linear method runs it unchanged. The exponent rule is selectable:

- ``floor``, ``even``, ``rceil``: the vendor rules of :mod:`.scale_rules` applied to the block
  maximum: the result is :func:`~.mx.quantize_mx` of the dequant under that rule;
- ``mse``: per block, among the exponents ``e0 - 1, e0, e0 + 1`` (``e0`` = the ``floor`` code, the
  others kept within 0..254) the one whose quantize-dequantize has the least squared error against
  the float32 block; ties go to ``e0``. The set holds every code ``floor``, ``even`` and ``rceil``
  can give (``e0`` or ``e0 + 1``), so ``mse`` is never worse than any of them on any block, and a
  block ``floor`` reproduces exactly keeps ``floor``'s bytes.

This definition holds the float32 dequant of a whole layer. What serving and ``convert`` run is
:func:`vllm_omni_mxfp4.kernels.requant.requantize_nvfp4`, which computes the same bytes and report
from lookup tables in row chunks; the tests hold it to this function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_omni_mxfp4 import spec

from .e2m1 import e2m1_decode, e2m1_encode, pack_fp4
from .mx import dequantize_mx, quantize_mx
from .nvfp4 import Nvfp4Weight, dequantize_nvfp4
from .scale_rules import e8m0_to_float, recip_scale, shared_exponent_codes

REQUANT_RULES = spec.REQUANT_RULES
"""The exponent rules requantization accepts (the one list in :mod:`vllm_omni_mxfp4.spec`)."""

MX_BLOCK = spec.MX_BLOCK
MAX_CODE = 254
"""The largest E8M0 code an exponent candidate may take (255 is NaN)."""


@dataclass(frozen=True)
class RequantError:
    """How far a layer's MXFP4 result is from its float32 NVFP4 dequant.

    ``rel_rms`` = ||mx - ref|| / ||ref|| over the whole layer (the absolute norm for an all-zero
    layer), ``max_abs`` = max |mx - ref|, ``exact_blocks`` / ``total_blocks`` = 32-blocks reproduced
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


def check_rule(rule: str) -> None:
    """Refuse a rule that is not one of :data:`REQUANT_RULES`."""
    if rule not in REQUANT_RULES:
        raise ValueError(f"rule must be one of {list(REQUANT_RULES)}, got {rule!r}")


def check_scales(w: Nvfp4Weight) -> None:
    """Refuse E4M3 NaN block scales (0x7F / 0xFF): MXFP4 would turn them into a NaN block."""
    nan = (w.scales.view(torch.uint8) & 0x7F) == 0x7F
    if bool(nan.any()):
        row = int(nan.any(dim=-1).nonzero()[0])
        raise ValueError(
            f"{w.name}: NaN block scale in row {row} (E4M3 0x7F/0xFF); the checkpoint is corrupt; "
            "re-export it or keep this layer unquantized"
        )


def _blocks(values: torch.Tensor) -> torch.Tensor:
    """``(N, G, 32)`` blocks of ``(N, K)`` values, a partial last block zero-padded."""
    n, k = values.shape
    pad = spec.ceil_div(k, MX_BLOCK) * MX_BLOCK - k
    return torch.nn.functional.pad(values, (0, pad)).reshape(n, -1, MX_BLOCK)


def _round_trip(blocks: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 codes, their dequantized values) of ``blocks`` under E8M0 ``codes`` (code 0 is a scale
    of 2^-127, not a zeroed block: only ``floor`` zeroes, and ``mse`` is defined without it)."""
    elements = e2m1_encode(blocks * recip_scale(codes, "mse").unsqueeze(-1))
    return elements, e2m1_decode(elements) * e8m0_to_float(codes).unsqueeze(-1)


def _squared_error(blocks: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Each block's squared quantize-dequantize error under ``codes``, in float64."""
    _, values = _round_trip(blocks, codes)
    return (values.double() - blocks.double()).square().sum(dim=-1)


def mse_codes(blocks: torch.Tensor) -> torch.Tensor:
    """The ``mse`` exponent of each block (module docstring): ``e0`` unless ``e0 - 1`` or ``e0 + 1``
    is strictly better."""
    e0 = shared_exponent_codes(blocks.abs().amax(dim=-1), "floor")
    best, best_error = e0, _squared_error(blocks, e0)
    for step in (-1, 1):
        other = e0 + step
        allowed = (other >= 0) & (other <= MAX_CODE)
        error = _squared_error(blocks, other.clamp(0, MAX_CODE))
        better = allowed & (error < best_error)
        best, best_error = torch.where(better, other, best), torch.where(better, error, best_error)
    return best


def _report(name: str, rule: str, ref: torch.Tensor, got: torch.Tensor) -> RequantError:
    diff = got.double() - ref.double()
    ref_norm, err_norm = float(ref.double().norm()), float(diff.norm())
    exact = (_blocks(diff) == 0).all(dim=-1)  # -0 == +0
    rel = err_norm / ref_norm if ref_norm else err_norm
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    return RequantError(name, rule, rel, max_abs, int(exact.sum()), exact.numel())


def requantize_nvfp4(w: Nvfp4Weight, rule: str = "mse") -> Requantized:
    """Requantize an NVFP4 weight to MXFP4 under ``rule`` (module docstring), with its error report."""
    check_rule(rule)
    check_scales(w)
    ref = dequantize_nvfp4(w)
    n, k = ref.shape
    if rule == "mse":
        codes = mse_codes(_blocks(ref))
        elements, _ = _round_trip(_blocks(ref), codes)
        data, scale = pack_fp4(elements.reshape(n, -1)[:, :k]), codes.to(torch.uint8)
    else:
        data, scale = quantize_mx(ref, scale_rule=rule)
    got = dequantize_mx(data, scale)
    return Requantized(data, scale, _report(w.name, rule, ref, got))
