"""The Ascend NPU kernels: torch_npu MX kernels on Ascend 950 (facts: ``docs/kernels.md``).

Single scale (``mxfp4``, :class:`NpuSingle`):

- online weights and A4 activations: ``npu_dynamic_mx_quant`` (FP4 E2M1 along the last axis,
  blocks of 32, ``round_mode="rint"``; ``scale_alg=0`` for the OCP rule, ``scale_alg=2`` with
  ``dst_type_max=7.25`` for UOS);
- the weight stays the canonical packed uint8 (N, K/2) parameter (numeric checkpoints were packed
  by the loader) and is passed as a transposed view with ``x2_dtype=float4_e2m1fn_x2``; its E8M0
  scales are re-laid as ``(N, ceil(G/2), 2)`` (odd G zero-padded) in a non-persistent buffer;
- GEMM: ``npu_quant_matmul`` with ``group_sizes=[1, 1, 32]``, transposed weight and scale views, a
  float32 bias and the caller's output dtype;
- W4A8: ``npu_dynamic_mx_quant(dst_type=float8_e4m3fn, scale_alg=0)`` activations, the same W4,
  ``group_sizes=[0, 0, 32]``, a bf16 ``(1, N)`` bias and a bf16 output cast back to the caller's
  dtype, so an fp16 caller gets bf16-rounded results (the kernel's only output type here).

MXFP8 W8A8 (``mxfp8``, :class:`NpuMxfp8`, the layers of ``mxfp8_layers``):

- activations (and online weights): ``npu_dynamic_mx_quant(dst_type=torch.float8_e4m3fn,
  scale_alg=0)``, the OCP rule; FP8 takes ``round_mode="rint"`` only;
- the weight stays the ``float8_e4m3fn`` (N, K) parameter, passed as a transposed view (no
  ``x*_dtype``: native FP8 tensors describe themselves); scales re-laid as ``(N, ceil(G/2), 2)``;
- GEMM: ``npu_quant_matmul`` in its MX FP8 mode, ``group_sizes=[1, 1, 32]``, a float32 bias (N,)
  and the caller's output dtype (fp16, bf16 or fp32).

Dual scale (``mxfp4_dualscale``, :class:`NpuDual`):

- ``npu_dynamic_dual_level_mx_quant`` for online weights (no Smooth) and activations (the Smooth
  vector in the activation dtype as ``smooth_scale``); bf16 for float32 callers, whose output is
  then bf16-rounded too (the kernel writes fp16 or bf16 only);
- the weight in FRACTAL_NZ via ``npu_format_cast(w.view(int8), 29, customize_dtype=int8)``,
  coarse scales transposed to ``(K/512, N)``, fine scales ``(N, K/64, 2)``, then
  ``npu_dual_level_quant_matmul``. K is zero-padded to whole 512-chunks (weights, scales and
  activations), the complete groups upstream documents as required.

Memory: the NZ weight replaces the ``weight`` parameter's storage (same logical shape, int8) so no
packed copy stays on the device; ``state_dict()`` converts it back with ``npu_format_cast(w, 2)``
(:meth:`~.base.Prepared.adopt_weight`). A row-parallel shard that needs K padding keeps its packed
parameter and holds the padded NZ copy in a buffer.

torch_npu is imported when a kernel is built, never at package import. No device is named:
every tensor is made on the device of the layer's own tensors.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
import torch.nn.functional as F

from ..config import Precision
from ..formats import from_npu_scale_layout, to_npu_scale_layout
from ..spec import DUAL_BLOCK, MX_BLOCK, UOS_DST_TYPE_MAX, WEIGHT_DUAL_SCALE, ceil_div, round_up
from .base import Call, MxKernel, MxLayerSpec, Prepared, as_uint8, checked_scale, installed, padded_weight

#: ``npu_dynamic_mx_quant`` arguments of each A4 scale rule.
SCALE_ALG_KWARGS: dict[str, dict[str, float]] = {
    "floor": {"scale_alg": 0},
    "uos": {"scale_alg": 2, "dst_type_max": UOS_DST_TYPE_MAX},
}
A4_GROUP_SIZES = [1, 1, 32]  # also MXFP8 W8A8's (MX mode: one scale per 32 of K on both sides)
W4A8_GROUP_SIZES = [0, 0, 32]
ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29


def import_torch_npu() -> ModuleType:
    """torch_npu, or a clear error saying what the NPU backend needs."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise RuntimeError(
            "MXFP4 backend 'npu' needs torch_npu with CANN on an Ascend 950 NPU "
            f"(import failed: {exc}). Use backend 'emulated' to run the same numerics on any device."
        ) from exc


class NpuKernel(MxKernel):
    """What the NPU kernels share: torch_npu, imported when the kernel is built."""

    backend = "npu"
    pad_input = True

    def __init__(self) -> None:
        self.npu = import_torch_npu()

    @classmethod
    def is_supported(cls) -> tuple[bool, str]:
        if not installed("torch_npu"):
            return False, "torch_npu is not installed"
        try:
            importlib.import_module("torch_npu")
            npu = getattr(torch, "npu", None)
            if npu is None or not npu.is_available() or npu.device_count() == 0:
                return False, "torch_npu imports but no NPU device is available"
        except Exception as exc:  # a broken CANN install must not stop the emulated path
            return False, f"torch_npu is installed but does not import ({exc.__class__.__name__}: {exc})"
        return True, "torch_npu imports and an NPU is present"

    def describe(self) -> str:
        version = getattr(self.npu, "__version__", "unknown version")
        return f"npu {self.format} (torch_npu {version})"


class NpuSingle(NpuKernel):
    """``mxfp4``: ``npu_dynamic_mx_quant`` + ``npu_quant_matmul``, A4 (FLOOR or UOS) and W4A8."""

    format = "mxfp4"
    w4a8 = True

    def _mx_quant(self, x: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
        if scale_rule not in SCALE_ALG_KWARGS:
            raise ValueError(
                f"npu backend: A4 scale rule must be one of {sorted(SCALE_ALG_KWARGS)}, got {scale_rule!r}"
            )
        return self.npu.npu_dynamic_mx_quant(
            x,
            axis=-1,
            round_mode="rint",
            dst_type=self.npu.float4_e2m1fn_x2,
            block_size=MX_BLOCK,
            **SCALE_ALG_KWARGS[scale_rule],
        )

    def _quantize_weight(self, weight: torch.Tensor, spec: MxLayerSpec) -> dict[str, torch.Tensor]:
        data, scale = self._mx_quant(weight, spec.scale_rule)
        groups = ceil_div(weight.shape[-1], MX_BLOCK)
        return {
            "weight": as_uint8(data),
            "weight_scale": from_npu_scale_layout(as_uint8(scale), groups).contiguous(),
        }

    def _prepare(self, layer: torch.nn.Module, spec: MxLayerSpec, smooth: torch.Tensor | None) -> Prepared:
        scale = checked_scale(layer, spec)
        padded = spec.k_pad_front or spec.k_pad_back
        weight = padded_weight(layer, spec) if padded else None
        return Prepared(spec, smooth, weight=weight, scale=to_npu_scale_layout(scale).contiguous())

    def _matmul(self, x: torch.Tensor, call: Call) -> torch.Tensor:
        e8m0, fp4 = self.npu.float8_e8m0fnu, self.npu.float4_e2m1fn_x2
        weight, scale, bias = call.weight(), call.prepared.scale, call.bias
        if call.precision is Precision.W4A8:
            x_q, x_scale = self.npu.npu_dynamic_mx_quant(
                x, axis=-1, round_mode="rint", dst_type=torch.float8_e4m3fn, block_size=MX_BLOCK, scale_alg=0
            )
            dtypes = {"output_dtype": torch.bfloat16, "x2_dtype": fp4, "group_sizes": W4A8_GROUP_SIZES}
            bias = None if bias is None else bias.to(torch.bfloat16).reshape(1, -1)
        else:
            x_q, x_scale = self._mx_quant(x, call.spec.scale_rule)
            dtypes = {
                "output_dtype": call.out_dtype,
                "x1_dtype": fp4,
                "x2_dtype": fp4,
                "group_sizes": A4_GROUP_SIZES,
            }
            bias = None if bias is None else bias.float()
        return self.npu.npu_quant_matmul(
            x_q,
            weight.transpose(0, 1),
            scale.transpose(0, 1),
            scale_dtype=e8m0,
            pertoken_scale=x_scale,
            pertoken_scale_dtype=e8m0,
            bias=bias,
            **dtypes,
        )


class NpuMxfp8(NpuKernel):
    """``mxfp8``: W8A8 MXFP8, ``npu_dynamic_mx_quant`` (E4M3, OCP) + ``npu_quant_matmul`` (MX FP8 mode)."""

    format = "mxfp8"
    a4_rules = ("floor",)

    def _fp8_quant(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.npu.npu_dynamic_mx_quant(
            x, axis=-1, round_mode="rint", dst_type=torch.float8_e4m3fn, block_size=MX_BLOCK, scale_alg=0
        )

    def _quantize_weight(self, weight: torch.Tensor, spec: MxLayerSpec) -> dict[str, torch.Tensor]:
        data, scale = self._fp8_quant(weight)
        groups = ceil_div(weight.shape[-1], MX_BLOCK)
        return {"weight": data, "weight_scale": from_npu_scale_layout(as_uint8(scale), groups).contiguous()}

    def _prepare(self, layer: torch.nn.Module, spec: MxLayerSpec, smooth: torch.Tensor | None) -> Prepared:
        weight = layer.weight.data
        if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (
            spec.out_features,
            spec.in_features,
        ):
            raise ValueError(
                f"{spec.prefix}.weight: expected float8_e4m3fn (N, K) = {(spec.out_features, spec.in_features)}, "
                f"got {weight.dtype} {tuple(weight.shape)}"
            )
        scale = checked_scale(layer, spec)
        padded = spec.k_pad_front or spec.k_pad_back
        weight = F.pad(weight, (spec.k_pad_front, spec.k_pad_back)) if padded else None
        return Prepared(spec, smooth, weight=weight, scale=to_npu_scale_layout(scale).contiguous())

    def _matmul(self, x: torch.Tensor, call: Call) -> torch.Tensor:
        e8m0 = self.npu.float8_e8m0fnu
        x_q, x_scale = self._fp8_quant(x)
        bias = None if call.bias is None else call.bias.float()
        return self.npu.npu_quant_matmul(
            x_q,
            call.weight().transpose(0, 1),
            call.prepared.scale.transpose(0, 1),
            scale_dtype=e8m0,
            pertoken_scale=x_scale,
            pertoken_scale_dtype=e8m0,
            bias=bias,
            output_dtype=call.out_dtype,
            group_sizes=A4_GROUP_SIZES,
        )


class NpuDual(NpuKernel):
    """``mxfp4_dualscale``: ``npu_dynamic_dual_level_mx_quant`` + ``npu_dual_level_quant_matmul`` (NZ)."""

    format = "mxfp4_dualscale"
    a4_rules = ("floor",)
    half_input = "before_smooth"  # the dual-level kernels take bf16/fp16 only
    smooth_in_quantizer = True

    def _quantize_weight(self, weight: torch.Tensor, spec: MxLayerSpec) -> dict[str, torch.Tensor]:
        if weight.dtype not in (torch.bfloat16, torch.float16):
            weight = weight.to(torch.bfloat16)  # the dual-level quantizer takes bf16/fp16 only
        data, level0, level1 = self.npu.npu_dynamic_dual_level_mx_quant(
            weight, smooth_scale=None, round_mode="rint"
        )
        groups = ceil_div(weight.shape[-1], MX_BLOCK)
        scale = from_npu_scale_layout(as_uint8(level1), groups).contiguous()
        return {"weight": as_uint8(data), "weight_scale": scale, "weight_dual_scale": level0.unsqueeze(-1)}

    def _prepare(self, layer: torch.nn.Module, spec: MxLayerSpec, smooth: torch.Tensor | None) -> Prepared:
        k_total = spec.k_padded
        k_chunks = round_up(k_total, DUAL_BLOCK)
        extra = k_chunks - k_total  # whole 512-chunks for the dual-level GEMM
        scale = checked_scale(layer, spec)
        scale = F.pad(scale, (0, k_chunks // MX_BLOCK - scale.shape[-1]))
        dual = layer.weight_dual_scale
        n, chunks, _ = WEIGHT_DUAL_SCALE.shape(spec.out_features, k_chunks)
        if dual.dim() == 3 and dual.shape[-1] == 1:
            dual = dual.squeeze(-1)
        if tuple(dual.shape) != (n, chunks):
            raise ValueError(
                f"{spec.prefix}.weight_dual_scale: expected float32 (N, {chunks}, 1) = "
                f"({n}, {chunks}, 1), got {tuple(layer.weight_dual_scale.shape)}"
            )
        weight = padded_weight(layer, spec)
        if extra:
            weight = F.pad(weight, (0, extra // 2))
        nz = self.npu.npu_format_cast(
            weight.contiguous().view(torch.int8), ACL_FORMAT_FRACTAL_NZ, customize_dtype=torch.int8
        )
        prepared = Prepared(
            spec,
            smooth,
            weight=None,
            scale=to_npu_scale_layout(scale).contiguous(),
            dual_t=dual.float().transpose(0, 1).contiguous(),
        )
        if spec.k_pad_front or spec.k_pad_back or extra:
            prepared.weight = nz
        else:
            prepared.adopt_weight(layer, nz, self.nz_to_checkpoint)
        prepared.k_extra = extra
        return prepared

    def nz_to_checkpoint(self, nz: torch.Tensor) -> torch.Tensor:
        """A FRACTAL_NZ weight back to packed uint8 (N, K/2) bytes."""
        return self.npu.npu_format_cast(nz, ACL_FORMAT_ND).view(torch.uint8)

    def _matmul(self, x: torch.Tensor, call: Call) -> torch.Tensor:
        x_q, x_level0, x_level1 = self.npu.npu_dynamic_dual_level_mx_quant(
            x, smooth_scale=call.smooth, round_mode="rint"
        )
        bias = None if call.bias is None else call.bias.float().contiguous()
        prepared = call.prepared
        return self.npu.npu_dual_level_quant_matmul(
            x_q,
            call.weight(),
            x_level0,
            prepared.dual_t,
            x_level1,
            prepared.scale,
            bias=bias,
            output_dtype=x.dtype,
        )
