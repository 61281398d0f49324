"""Emulated kernels: the NPU kernels' MXFP4 numerics in plain PyTorch, on any device.

Weights are quantized with the formats core exactly as the NPU kernels do (``quantize_mx`` with
the configured rule, ``quantize_dualscale``), activations go through the same quantizer and are
dequantized again, and the GEMM runs on the dequantized values:

    y = dequant(W) @ qdq(x * smooth)^T + b

- :class:`EmulatedSingle` (``mxfp4``): every dequantized value (E2M1 x 2^k, E4M3 x 2^k) is exact
  in bfloat16, so a bf16 GEMM (fp32 accumulation) sees exactly the values the NPU GEMM sees; only
  the summation order differs. With ``compute_dtype="float32"`` the GEMM runs in float32 and the
  output equals the float32 reference bit for bit. W4A8 mirrors the NPU mixed kernel: E4M3
  activations (FLOOR), a bf16 bias and a bf16-rounded output, cast back to the caller's dtype.
- :class:`EmulatedMxfp8` (``mxfp8``, the W8A8 layers of ``mxfp8_layers``): E4M3 weights with E8M0
  scales per 32, activations quantized to MXFP8 with the OCP rule (``floor(log2 amax) - 8``, the
  NPU's ``scale_alg=0`` and msModelSlim's simulation); every dequantized value (E4M3 x 2^k) is
  exact in bfloat16, so the GEMM dtypes are :class:`EmulatedSingle`'s.
- :class:`EmulatedDual` (``mxfp4_dualscale``): dequantized values carry the float32 coarse scale
  and are not bf16-exact, so it computes in float32; float32 callers are computed from bf16
  activations and get a bf16-rounded output, as the NPU dual-level kernels (fp16/bf16 only).

Options, read when the kernel is built (constructor arguments, else the environment through
:mod:`vllm_omni_mxfp4.envs`): ``cache_dequantized`` (``VLLM_OMNI_MXFP4_EMULATED_CACHE``, default
on: keep the dequantized weight, 4x the packed bytes for single scale, instead of dequantizing on
every call) and ``compute_dtype`` (``VLLM_OMNI_MXFP4_EMULATED_COMPUTE``: ``auto`` or ``float32``).
The ROCm backend's numerics are :class:`~.emulated_rocm.EmulatedAiterSingle`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import envs
from ..config import Precision
from ..formats import (
    dequantize_dualscale,
    dequantize_mx,
    dequantize_mxfp8,
    fake_quantize_mx,
    fake_quantize_mxfp8,
    quantize_dualscale,
    quantize_mx,
    quantize_mxfp8,
)
from .base import Call, MxKernel, MxLayerSpec, Prepared

COMPUTE_DTYPES = ("auto", "float32")


class EmulatedKernel(MxKernel):
    """What the emulated kernels share: their options and the (cached) dequantized weight."""

    backend = "emulated"
    #: dtype of the dequantized weight for ``compute_dtype="auto"``.
    auto_weight_dtype: torch.dtype = torch.bfloat16
    #: K elements per index of the stored weight's last axis (2: packed FP4 bytes; 1: FP8 elements).
    weight_k_per_index: int = 2

    def __init__(self, *, cache_dequantized: bool | None = None, compute_dtype: str | None = None) -> None:
        if compute_dtype is None:
            compute_dtype = envs.emulated_compute()
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"emulated compute_dtype must be 'auto' or 'float32', got {compute_dtype!r}")
        self.cache_dequantized = envs.emulated_cache() if cache_dequantized is None else cache_dequantized
        self.compute_dtype = compute_dtype

    @property
    def mirror(self) -> str:
        """The ``VLLM_OMNI_MXFP4_EMULATED_MIRROR`` value that selects this kernel."""
        return "npu"

    def describe(self) -> str:
        cache = "cached dequantized weights" if self.cache_dequantized else "packed weights"
        return f"emulated {self.format} ({cache}, compute {self.compute_dtype}, {self.mirror} numerics)"

    def _weight_dtype(self) -> torch.dtype:
        return torch.float32 if self.compute_dtype == "float32" else self.auto_weight_dtype

    @staticmethod
    def _dequantize(packed: torch.Tensor, layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_mx(packed, layer.weight_scale, dtype=dtype)

    def dequantized_weight(self, layer: torch.nn.Module, spec: MxLayerSpec) -> torch.Tensor:
        """The layer's weight (N, K), dequantized from its checkpoint tensors."""
        packed = layer.weight
        front, back = spec.k_pad_front, spec.k_pad_back
        if front or back:
            # Scales cover whole blocks past this shard's K range: line the elements up with them.
            per = self.weight_k_per_index
            packed = F.pad(packed, (front // per, back // per))
        w = self._dequantize(packed, layer, self._weight_dtype())
        return w[:, front : front + spec.in_features] if (front or back) else w

    def _prepare(self, layer: torch.nn.Module, spec: MxLayerSpec, smooth: torch.Tensor | None) -> Prepared:
        cached = self.dequantized_weight(layer, spec) if self.cache_dequantized else None
        return Prepared(spec, smooth, dequantized=cached)

    def _compute_dtype(self, x_dtype: torch.dtype) -> torch.dtype:
        """bf16 GEMMs for bf16 callers (exact products of bf16-exact values), float32 otherwise."""
        if self.compute_dtype == "float32" or x_dtype != torch.bfloat16:
            return torch.float32
        return torch.bfloat16

    def _weight(self, call: Call) -> torch.Tensor:
        weight = call.prepared.dequantized
        return self.dequantized_weight(call.layer, call.spec) if weight is None else weight


class EmulatedSingle(EmulatedKernel):
    """``mxfp4`` with the NPU's numerics: A4 (FLOOR or UOS) and W4A8, bf16 or float32 GEMM."""

    format = "mxfp4"
    w4a8 = True

    def _quantize_weight(self, weight: torch.Tensor, spec: MxLayerSpec) -> dict[str, torch.Tensor]:
        data, scale = quantize_mx(weight, elem="fp4", scale_rule=spec.scale_rule)
        return {"weight": data, "weight_scale": scale}

    def _matmul(self, x: torch.Tensor, call: Call) -> torch.Tensor:
        spec, a8 = call.spec, call.precision is Precision.W4A8
        if a8:
            xq = aligned(spec, x, lambda xp: fake_quantize_mx(xp, elem="fp8", scale_rule="floor"))
        else:
            xq = aligned(spec, x, lambda xp: fake_quantize_mx(xp, elem="fp4", scale_rule=spec.scale_rule))
        weight = self._weight(call)
        compute = self._compute_dtype(call.out_dtype)
        if a8:
            # NPU W4A8: a bf16 bias (1, N) and a bf16 output, then the caller's dtype.
            b = None if call.bias is None else call.bias.to(torch.bfloat16).to(compute)
            return F.linear(xq.to(compute), weight.to(compute), b).to(torch.bfloat16)
        b = None if call.bias is None else call.bias.to(compute)
        return F.linear(xq.to(compute), weight.to(compute), b)


class EmulatedMxfp8(EmulatedKernel):
    """``mxfp8``: W8A8 MXFP8 (E4M3 weights and activations, OCP scales), bf16 or float32 GEMM."""

    format = "mxfp8"
    a4_rules = ("floor",)  # the OCP rule, whatever mxfp4_scale_alg says about FP4 activations
    weight_k_per_index = 1

    def _quantize_weight(self, weight: torch.Tensor, spec: MxLayerSpec) -> dict[str, torch.Tensor]:
        data, scale = quantize_mxfp8(weight)
        return {"weight": data, "weight_scale": scale}

    @staticmethod
    def _dequantize(data: torch.Tensor, layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_mxfp8(data, layer.weight_scale, dtype=dtype)

    def _matmul(self, x: torch.Tensor, call: Call) -> torch.Tensor:
        xq = aligned(call.spec, x, fake_quantize_mxfp8)
        compute = self._compute_dtype(call.out_dtype)
        b = None if call.bias is None else call.bias.to(compute)
        return F.linear(xq.to(compute), self._weight(call).to(compute), b)


class EmulatedDual(EmulatedKernel):
    """``mxfp4_dualscale`` with the NPU dual-level kernels' numerics, float32 GEMM."""

    format = "mxfp4_dualscale"
    a4_rules = ("floor",)
    auto_weight_dtype = torch.float32
    half_input = "before_smooth"  # the dual-level kernels take bf16/fp16 only

    def _quantize_weight(self, weight: torch.Tensor, spec: MxLayerSpec) -> dict[str, torch.Tensor]:
        if weight.dtype not in (torch.bfloat16, torch.float16):
            weight = weight.to(torch.bfloat16)  # the NPU dual-level quantizer takes bf16/fp16 only
        data, scale, dual = quantize_dualscale(weight)
        return {"weight": data, "weight_scale": scale, "weight_dual_scale": dual.unsqueeze(-1)}

    @staticmethod
    def _dequantize(packed: torch.Tensor, layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_dualscale(packed, layer.weight_scale, layer.weight_dual_scale, dtype=dtype)

    def _matmul(self, x: torch.Tensor, call: Call) -> torch.Tensor:
        xq = aligned(
            call.spec, x, lambda xp: dequantize_dualscale(*quantize_dualscale(xp), dtype=torch.float32)
        )
        weight = self._weight(call)
        b = None if call.bias is None else call.bias.to(torch.float32)
        out = F.linear(xq.to(torch.float32), weight.to(torch.float32), b)
        return out.to(x.dtype)  # the dual-level GEMM writes bf16/fp16 (x's dtype by now)


def aligned(spec: MxLayerSpec, x: torch.Tensor, qdq: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``qdq`` of ``x`` zero-padded by the spec's K padding (blocks line up with the scales; blocks
    shared with other ranks carry the group's maximum, :class:`~.base.SharedBlocks`), cut back."""
    front, back = spec.k_pad_front, spec.k_pad_back
    if not (front or back):
        return qdq(x)
    padded = F.pad(x, (front, back))
    if spec.shared is not None:
        padded = spec.shared.stamp(padded, None)
    return qdq(padded)[:, front : front + spec.in_features]
