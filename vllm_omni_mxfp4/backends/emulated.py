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
output, cast back to the caller's dtype (an fp16 caller sees bf16 rounding). Dual scale mirrors the
NPU dual-level kernels: float32 callers are computed from bf16 activations and get a bf16-rounded
output (the kernel writes fp16 or bf16 only).

Options (constructor or environment, read once per process):

- ``cache_dequantized`` (``VLLM_OMNI_MXFP4_EMULATED_CACHE``, default on): keep the dequantized
  weight (bf16 for single scale, float32 for dual scale) as a non-persistent buffer; 4x (single)
  the packed weight's memory, but no weight dequantization per call. Off: the weight stays packed
  and is dequantized on every call.
- ``compute_dtype`` (``VLLM_OMNI_MXFP4_EMULATED_COMPUTE``): ``auto`` (bf16 for bf16 single-scale
  layers, float32 otherwise) or ``float32``.
- ``mirror`` (``VLLM_OMNI_MXFP4_EMULATED_MIRROR``): whose numerics to reproduce. ``npu`` (the
  default): everything above. ``rocm:<rule>`` (``rocm`` alone means ``rocm:rceil``): the ROCm
  backend's, with ``<rule>`` the scale rule of the AITER in question (``rceil`` since 2026-06,
  ``aiter_legacy`` before; :meth:`RocmBackend.scale_rule` reports it): online weights and A4
  activations use that rule instead of FLOOR, float32 inputs are rounded to bf16 (after Smooth),
  the GEMM output is bf16-rounded and the bias is added after it in float32; UOS activations,
  W4A8 and dual scale are refused as the ROCm backend refuses them.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from ..formats import dequantize_dualscale, dequantize_mx, fake_quantize_mx, quantize_dualscale, quantize_mx
from .base import (
    MxBackend,
    MxLayerSpec,
    aiter_refusal,
    check_aiter_supported,
    restore_checkpoint_weight,
    set_buffer,
)

logger = logging.getLogger(__name__)

_AITER_RULES = ("rceil", "aiter_legacy", "even", "floor")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_mirror(mirror: str) -> str | None:
    """The AITER scale rule a ``mirror`` value selects (None for ``npu``); errors name the choices."""
    value = mirror.strip().lower()
    if value == "npu":
        return None
    if value == "rocm":
        return "rceil"
    kind, _, rule = value.partition(":")
    if kind == "rocm" and rule in _AITER_RULES:
        return rule
    choices = ", ".join(["'npu'", "'rocm'", *(f"'rocm:{r}'" for r in _AITER_RULES)])
    raise ValueError(f"emulated mirror must be one of {choices}; got {mirror!r}")


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

    def __init__(
        self,
        *,
        cache_dequantized: bool | None = None,
        compute_dtype: str | None = None,
        mirror: str | None = None,
    ) -> None:
        if mirror is None:
            mirror = os.environ.get("VLLM_OMNI_MXFP4_EMULATED_MIRROR", "npu").strip() or "npu"
        self.aiter_rule = parse_mirror(mirror)
        self.mirror = "npu" if self.aiter_rule is None else f"rocm:{self.aiter_rule}"
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
        return f"emulated ({cache}, compute {self.compute_dtype}, {self.mirror} numerics)"

    def _who(self) -> str:
        return (
            f"the emulated backend mirroring ROCm (mirror={self.mirror!r}; use mirror='npu' for everything)"
        )

    def check_supported(self, prefix: str, *, dual_scale: bool, scale_rule: str, w4a8: bool) -> None:
        if self.aiter_rule is not None:
            check_aiter_supported(
                prefix, dual_scale=dual_scale, scale_rule=scale_rule, w4a8=w4a8, who=self._who()
            )

    def quantize_weight(self, weight: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.aiter_rule is not None:
            check_aiter_supported("", dual_scale=False, scale_rule=scale_rule, w4a8=False, who=self._who())
            if weight.dtype not in (torch.bfloat16, torch.float16):
                weight = weight.to(torch.bfloat16)  # AITER's quantizer takes bf16/fp16
            scale_rule = self.aiter_rule
        return quantize_mx(weight, elem="fp4", scale_rule=scale_rule)

    def quantize_weight_dualscale(
        self, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.aiter_rule is not None:
            raise aiter_refusal("", dual_scale=True, scale_rule="floor", w4a8=False, who=self._who())
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
        if self.aiter_rule is not None:
            check_aiter_supported(
                spec.prefix,
                dual_scale=spec.dual_scale,
                scale_rule=spec.act_scale_rule,
                w4a8=False,
                who=self._who(),
            )
        restore_checkpoint_weight(layer)  # a vendor backend may have put its layout in ``weight``
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
        if self.aiter_rule is not None:
            return self._linear_aiter(layer, spec, x, bias, a8=a8)
        out_dtype = x.dtype
        if spec.dual_scale and x.dtype not in (torch.bfloat16, torch.float16):
            x = x.to(torch.bfloat16)  # as the NPU path does for float32 callers
        if spec.has_smooth:
            x = x * layer._mx_smooth.to(x.dtype)
        if spec.dual_scale:
            xq = _aligned(
                spec, x, lambda xp: dequantize_dualscale(*quantize_dualscale(xp), dtype=torch.float32)
            )
        elif a8:
            xq = _aligned(spec, x, lambda xp: fake_quantize_mx(xp, elem="fp8", scale_rule="floor"))
        else:
            xq = _aligned(
                spec, x, lambda xp: fake_quantize_mx(xp, elem="fp4", scale_rule=spec.act_scale_rule)
            )
        weight = layer._buffers.get("_mx_weight_dequant")
        if weight is None:
            weight = self._dequantized_weight(layer, spec)
        compute = self._compute_dtype(spec, out_dtype)
        if a8:
            # NPU W4A8: a bf16 bias (1, N) and a bf16 output, then the caller's dtype.
            b = None if bias is None else bias.to(torch.bfloat16).to(compute)
            return F.linear(xq.to(compute), weight.to(compute), b).to(torch.bfloat16).to(out_dtype)
        b = None if bias is None else bias.to(compute)
        out = F.linear(xq.to(compute), weight.to(compute), b)
        if spec.dual_scale:
            out = out.to(x.dtype)  # the dual-level GEMM writes bf16/fp16 (x's dtype by now)
        return out.to(out_dtype)

    def _linear_aiter(
        self,
        layer: torch.nn.Module,
        spec: MxLayerSpec,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        a8: bool,
    ) -> torch.Tensor:
        """The ROCm backend's numerics: AITER's rule, bf16 inputs, bf16 GEMM output, bias after."""
        if a8:
            check_aiter_supported(
                spec.prefix, dual_scale=False, scale_rule="floor", w4a8=True, who=self._who()
            )
        out_dtype = x.dtype
        if spec.has_smooth:
            x = x * layer._mx_smooth.to(x.dtype)
        if x.dtype not in (torch.bfloat16, torch.float16):
            x = x.to(torch.bfloat16)
        xq = _aligned(spec, x, lambda xp: fake_quantize_mx(xp, elem="fp4", scale_rule=self.aiter_rule))
        weight = layer._buffers.get("_mx_weight_dequant")
        if weight is None:
            weight = self._dequantized_weight(layer, spec)
        compute = self._compute_dtype(spec, x.dtype)
        out = F.linear(xq.to(compute), weight.to(compute)).to(torch.bfloat16)
        if bias is not None:
            out = out.float() + bias.float()
        return out.to(out_dtype)


def _aligned(spec: MxLayerSpec, x: torch.Tensor, qdq) -> torch.Tensor:
    """``qdq`` of ``x`` zero-padded by the spec's K padding (blocks line up with the scales), cut back."""
    front, back = spec.k_pad_front, spec.k_pad_back
    if not (front or back):
        return qdq(x)
    return qdq(F.pad(x, (front, back)))[:, front : front + spec.in_features]
