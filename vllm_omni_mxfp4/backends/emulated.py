"""The emulated backend: vendor MXFP4 numerics in plain PyTorch, on any device.

Weights are quantized with the formats core exactly as the NPU kernels do (``quantize_mx`` with
the configured rule, ``quantize_dualscale``), activations go through the same quantizer and are
dequantized again, and the GEMM runs on the dequantized values:

    y = dequant(W) @ qdq(x * smooth)^T + b

Single scale: every dequantized value (E2M1 x 2^k, E4M3 x 2^k) is exact in bfloat16, so a bf16
GEMM (fp32 accumulation) sees exactly the values the NPU GEMM sees; only the summation order
differs. With ``compute_dtype="float32"`` the GEMM runs in float32 and the output equals the
float32 reference bit for bit. Dual scale: dequantized values carry the float32 coarse scale and
are not bf16-exact, so dual-scale layers compute in float32 unless told otherwise.

W4A8 mirrors the NPU mixed kernel: E4M3 activations (FLOOR), a bf16 bias and a bf16-rounded
output, cast back to the caller's dtype (an fp16 caller sees bf16 rounding).

Options (constructor or environment, read once per process):

- ``cache_dequantized`` (``VLLM_OMNI_MXFP4_EMULATED_CACHE``, default on): keep the dequantized
  weight (bf16 for single scale, float32 for dual scale) as a non-persistent buffer; 4x (single)
  the packed weight's memory, but no weight dequantization per call. Off: the weight stays packed
  and is dequantized on every call.
- ``compute_dtype`` (``VLLM_OMNI_MXFP4_EMULATED_COMPUTE``): ``auto`` (bf16 for bf16 single-scale
  layers, float32 otherwise) or ``float32``.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from ..formats import dequantize_dualscale, dequantize_mx, fake_quantize_mx, quantize_dualscale, quantize_mx
from .base import MxBackend, MxLayerSpec, set_buffer

logger = logging.getLogger(__name__)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {_TRUE + _FALSE}, got {value!r}")


class EmulatedBackend(MxBackend):
    """MXFP4 Linears computed from the formats core; bit-exact quantizers, float GEMM."""

    name = "emulated"

    def __init__(self, *, cache_dequantized: bool | None = None, compute_dtype: str | None = None) -> None:
        if cache_dequantized is None:
            cache_dequantized = _env_flag("VLLM_OMNI_MXFP4_EMULATED_CACHE", True)
        if compute_dtype is None:
            compute_dtype = (
                os.environ.get("VLLM_OMNI_MXFP4_EMULATED_COMPUTE", "auto").strip().lower() or "auto"
            )
        if compute_dtype not in ("auto", "float32"):
            raise ValueError(f"emulated compute_dtype must be 'auto' or 'float32', got {compute_dtype!r}")
        self.cache_dequantized = cache_dequantized
        self.compute_dtype = compute_dtype

    def describe(self) -> str:
        cache = "cached dequantized weights" if self.cache_dequantized else "packed weights"
        return f"emulated ({cache}, compute {self.compute_dtype})"

    def quantize_weight(self, weight: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_mx(weight, elem="fp4", scale_rule=scale_rule)

    def quantize_weight_dualscale(
        self, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if weight.dtype not in (torch.bfloat16, torch.float16):
            weight = weight.to(torch.bfloat16)  # the NPU dual-level quantizer takes bf16/fp16 only
        return quantize_dualscale(weight)

    def _weight_dtype(self, spec: MxLayerSpec) -> torch.dtype:
        return torch.float32 if (spec.dual_scale or self.compute_dtype == "float32") else torch.bfloat16

    def _dequantized_weight(self, layer: torch.nn.Module, spec: MxLayerSpec) -> torch.Tensor:
        dtype = self._weight_dtype(spec)
        packed = layer.weight
        front, back = spec.k_pad_front, spec.k_pad_back
        if front or back:
            # Scales cover whole blocks past this shard's K range: line the bytes up with them.
            packed = torch.nn.functional.pad(packed, (front // 2, back // 2))
        if spec.dual_scale:
            w = dequantize_dualscale(packed, layer.weight_scale, layer.weight_dual_scale, dtype=dtype)
        else:
            w = dequantize_mx(packed, layer.weight_scale, dtype=dtype)
        return w[:, front : front + spec.in_features] if (front or back) else w

    def prepare(self, layer: torch.nn.Module, spec: MxLayerSpec) -> None:
        cached = self._dequantized_weight(layer, spec) if self.cache_dequantized else None
        set_buffer(layer, "_mx_weight_dequant", cached)

    def _compute_dtype(self, spec: MxLayerSpec, x_dtype: torch.dtype) -> torch.dtype:
        if spec.dual_scale or self.compute_dtype == "float32" or x_dtype != torch.bfloat16:
            return torch.float32
        return torch.bfloat16

    def linear(
        self,
        layer: torch.nn.Module,
        spec: MxLayerSpec,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        a8: bool,
    ) -> torch.Tensor:
        out_dtype = x.dtype
        if spec.dual_scale and x.dtype not in (torch.bfloat16, torch.float16):
            x = x.to(torch.bfloat16)  # as the NPU path does for float32 callers
        if spec.has_smooth:
            x = x * layer._mx_smooth.to(x.dtype)
        if spec.dual_scale:
            front, back = spec.k_pad_front, spec.k_pad_back
            xp = torch.nn.functional.pad(x, (front, back)) if (front or back) else x
            xq = dequantize_dualscale(*quantize_dualscale(xp), dtype=torch.float32)
            if front or back:
                xq = xq[:, front : front + spec.in_features]
        elif a8:
            xq = fake_quantize_mx(x, elem="fp8", scale_rule="floor")
        else:
            xq = fake_quantize_mx(x, elem="fp4", scale_rule=spec.act_scale_rule)
        weight = layer._buffers.get("_mx_weight_dequant")
        if weight is None:
            weight = self._dequantized_weight(layer, spec)
        compute = self._compute_dtype(spec, out_dtype)
        if a8:
            # NPU W4A8: a bf16 bias (1, N) and a bf16 output, then the caller's dtype.
            b = None if bias is None else bias.to(torch.bfloat16).to(compute)
            return F.linear(xq.to(compute), weight.to(compute), b).to(torch.bfloat16).to(out_dtype)
        b = None if bias is None else bias.to(compute)
        return F.linear(xq.to(compute), weight.to(compute), b).to(out_dtype)
