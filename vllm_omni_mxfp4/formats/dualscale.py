"""Dual-level ("DualScale") MXFP4: a float32 scale per 512 elements over FLOOR MXFP4 per 32.

This mirrors torch_npu ``npu_dynamic_dual_level_mx_quant`` (docs/kernels.md), step by step, in the
input dtype (bf16 or fp16; fp32 inputs are processed in fp32):

1. Smooth: ``xs = x * smooth`` in the input dtype (one rounding), when ``smooth`` is given;
2. per 512-chunk (zero-padded past K): ``amax`` of |xs| ignoring Inf/NaN,
   ``L0 = fp32(amax) * fp32(1/6)`` (a multiply, not a divide), flushed to 0 below 2^-126;
3. ``t = xs / L0`` in float32, rounded once to the input dtype; zeros stay (signed) zeros;
4. FLOOR MXFP4 per 32 on ``t`` (:func:`~.mx.quantize_mx` with ``scale_rule="floor"``).

Dequantization: e2m1 x 2^(code - 127) x L0, divided by ``smooth`` when given.
"""

from __future__ import annotations

import torch

from vllm_omni_mxfp4 import spec

from .mx import MX_BLOCK_SIZE, dequantize_mx, quantize_mx
from .rows import check_float_input, from_blocks, row_chunks, row_count, to_blocks

DUAL_BLOCK_SIZE = spec.DUAL_BLOCK
_INV_MAX = 1.0 / spec.E2M1_MAX
_FP32_MIN_NORMAL = 2.0**-126


def _check_smooth(smooth: torch.Tensor, k: int, name: str) -> None:
    if smooth.dim() != 1 or smooth.shape[0] != k:
        raise ValueError(f"{name}: smooth must be 1-D of length K={k}, got shape {tuple(smooth.shape)}")
    if not smooth.is_floating_point():
        raise TypeError(f"{name}: smooth must be a floating tensor, got {smooth.dtype}")


def level0_scales(xs: torch.Tensor) -> torch.Tensor:
    """float32 coarse scales (..., ceil(K/512)) of (already smoothed) ``xs``: amax/6 per 512."""
    chunks = spec.ceil_div(xs.shape[-1], DUAL_BLOCK_SIZE)
    mag = xs.abs().float()
    mag = torch.where(torch.isfinite(mag), mag, torch.zeros_like(mag))
    amax = to_blocks(mag, chunks, DUAL_BLOCK_SIZE).amax(dim=-1)
    l0 = amax * torch.tensor(_INV_MAX, dtype=torch.float32, device=xs.device)
    return torch.where(l0 < _FP32_MIN_NORMAL, torch.zeros_like(l0), l0)


def quantize_dualscale(
    x: torch.Tensor, *, smooth: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dual-level MXFP4 of ``x`` (..., K): ``(data, scale, dual_scale)``.

    ``data`` uint8 (..., K/2) packed E2M1; ``scale`` uint8 E8M0 (..., ceil(K/32));
    ``dual_scale`` float32 (..., ceil(K/512)). ``smooth`` (K,) multiplies ``x`` first (Smooth /
    ``mul_scale``), cast to ``x``'s dtype as the NPU kernel requires.
    """
    check_float_input(x, "quantize_dualscale")
    k = x.shape[-1]
    if k % 2:
        raise ValueError(f"quantize_dualscale: K must be even, got shape {tuple(x.shape)}")
    if smooth is not None:
        _check_smooth(smooth, k, "quantize_dualscale")
        smooth = smooth.to(device=x.device, dtype=x.dtype)
    rows = row_count(x)
    flat = x.reshape(rows, k)
    chunks = spec.ceil_div(k, DUAL_BLOCK_SIZE)
    data = torch.empty((rows, k // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((rows, spec.ceil_div(k, MX_BLOCK_SIZE)), dtype=torch.uint8, device=x.device)
    dual = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    for rows_at in row_chunks(rows, chunks * DUAL_BLOCK_SIZE, x.device):
        xs = flat[rows_at] if smooth is None else flat[rows_at] * smooth
        l0 = level0_scales(xs)
        data[rows_at], scale[rows_at] = quantize_mx(_normalise(xs, l0), elem="fp4", scale_rule="floor")
        dual[rows_at] = l0
    lead = x.shape[:-1]
    return data.reshape(*lead, k // 2), scale.reshape(*lead, scale.shape[-1]), dual.reshape(*lead, chunks)


def _normalise(xs: torch.Tensor, l0: torch.Tensor) -> torch.Tensor:
    """t = xs / L0 per 512-chunk, in float32, rounded once to xs's dtype; zeros keep their sign."""
    grouped = to_blocks(xs.float(), l0.shape[-1], DUAL_BLOCK_SIZE)
    t = torch.where(grouped == 0, grouped, grouped / l0.unsqueeze(-1))
    return from_blocks(t, xs.shape[-1]).to(xs.dtype)


def dequantize_dualscale(
    data: torch.Tensor,
    scale: torch.Tensor,
    dual_scale: torch.Tensor,
    *,
    smooth: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Values of dual-level MXFP4 data: e2m1 x 2^(scale-127) x dual_scale [/ smooth], in ``dtype``.

    ``dual_scale`` is float32 (..., ceil(K/512)) or the checkpoint layout (..., ceil(K/512), 1).
    """
    k = data.shape[-1] * 2
    chunks = spec.ceil_div(k, DUAL_BLOCK_SIZE)
    if dual_scale.dim() == data.dim() + 1 and dual_scale.shape[-1] == 1:
        dual_scale = dual_scale.squeeze(-1)
    if tuple(dual_scale.shape) != (*data.shape[:-1], chunks):
        raise ValueError(
            f"dequantize_dualscale: dual_scale shape {tuple(dual_scale.shape)} does not match data shape "
            f"{tuple(data.shape)}; expected {(*data.shape[:-1], chunks)} (or with a trailing 1)"
        )
    values = dequantize_mx(data, scale, elem="fp4", dtype=torch.float32)
    grouped = to_blocks(values, chunks, DUAL_BLOCK_SIZE) * dual_scale.float().unsqueeze(-1)
    out = from_blocks(grouped, k)
    if smooth is not None:
        _check_smooth(smooth, k, "dequantize_dualscale")
        out = out / smooth.float()
    return out.to(dtype)
