"""MXFP8 (OCP MX v1.0, E4M3 elements, one E8M0 scale per 32): what an MXFP8 W8A8 layer computes.

msModelSlim's Wan2.2 recipes store blocks 0-4 as W8A8 MXFP8: ``float8_e4m3fn`` weights (N, K) with
uint8 E8M0 codes (N, K/32), weights chosen by ``mse_round`` (stored, so nothing here re-derives
them), activations quantized at run time with the OCP rule ``floor(log2 amax) - 8`` per block of 32
(msModelSlim's ``calculate_mx_qparam``; the NPU's ``npu_dynamic_mx_quant`` with ``scale_alg=0``).

- :func:`e4m3_decode` / :func:`e4m3_encode`: FP8 E4M3 codes <-> values. Decoding reads the bit
  fields (bias 7, subnormals ``m * 2^-9``, 0x7F / 0xFF NaN), independent of torch's cast; encoding is
  torch's ``float8_e4m3fn`` cast (round to nearest even) after saturating to +-448, as the kernels
  do (torch 2.13's CPU cast saturates too, Inf included; clamping first keeps the result independent
  of the torch version and of the device's cast).
- :func:`quantize_mxfp8`, :func:`dequantize_mxfp8`, :func:`fake_quantize_mxfp8`: the MX block
  pipeline of :mod:`.mx` with ``elem="fp8"`` and the OCP FLOOR rule (``scale_rules.codes_floor``:
  emax 8 for E4M3; a block whose code would be <= 0 is zeroed, as the NPU does).
"""

from __future__ import annotations

import torch

from vllm_omni_mxfp4 import spec

from .mx import dequantize_mx, fake_quantize_mx, quantize_mx

E4M3_MAX = spec.E4M3_MAX
E4M3_BIAS = 7
MXFP8_SCALE_RULE = "floor"
"""The activation scale rule of MXFP8 W8A8 layers: OCP, shared exponent ``floor(log2 amax) - 8``."""


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of FP8 E4M3 codes (uint8, or a ``float8_e4m3fn`` tensor read as its bytes).

    From the bit fields: sign bit 7, exponent bits 6-3 (bias 7), mantissa bits 2-0; exponent 0 is
    subnormal (``m / 8 * 2^-6``); magnitude 0x7F is NaN (E4M3 "fn" has no Inf).
    """
    if codes.dtype == torch.float8_e4m3fn:
        codes = codes.view(torch.uint8)
    if codes.dtype != torch.uint8:
        raise TypeError(f"e4m3_decode: codes must be uint8 or float8_e4m3fn, got {codes.dtype}")
    c = codes.to(torch.int32)
    exponent, mantissa = (c >> 3) & 0xF, (c & 0x7).float()
    normal = (1.0 + mantissa / 8.0) * torch.pow(2.0, (exponent - E4M3_BIAS).float())
    subnormal = mantissa / 8.0 * 2.0 ** (1 - E4M3_BIAS)
    magnitude = torch.where(exponent == 0, subnormal, normal)
    magnitude = torch.where((c & 0x7F) == spec.E4M3_NAN_MAGNITUDE, float("nan"), magnitude)
    return torch.where((c & 0x80) != 0, -magnitude, magnitude)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 codes (uint8) of ``x``: round to nearest even, saturating at +-448; NaN -> 0x7F."""
    if not x.is_floating_point():
        raise TypeError(f"e4m3_encode: x must be a floating-point tensor, got {x.dtype}")
    x = x.float()
    saturated = torch.where(torch.isnan(x), x, x.clamp(-E4M3_MAX, E4M3_MAX))
    return saturated.to(torch.float8_e4m3fn).view(torch.uint8)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., K) -> (``float8_e4m3fn`` (..., K), uint8 E8M0 codes (..., ceil(K/32))), OCP rule."""
    return quantize_mx(x, elem="fp8", scale_rule=MXFP8_SCALE_RULE)


def dequantize_mxfp8(
    data: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Values of MXFP8 data: E4M3 value x 2^(code - 127) in ``dtype`` (exact in float32 and bf16,
    whose 8 exponent bits hold every product; code 0xFF gives NaN)."""
    return dequantize_mx(data, scale, elem="fp8", dtype=dtype)


def fake_quantize_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize ``x`` as MXFP8 activations (OCP rule), in ``x``'s dtype."""
    return fake_quantize_mx(x, elem="fp8", scale_rule=MXFP8_SCALE_RULE)
