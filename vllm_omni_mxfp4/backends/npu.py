"""The Ascend NPU backend: torch_npu MX kernels on Ascend 950 (research/kernels.md §2, §3).

Single scale (``mxfp4``):

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

Dual scale (``mxfp4_dualscale``):

- ``npu_dynamic_dual_level_mx_quant`` for online weights (no Smooth) and activations (the Smooth
  vector in the activation dtype as ``smooth_scale``); bf16 for float32 callers, whose output is
  then bf16-rounded too (the kernel writes fp16 or bf16 only);
- the weight in FRACTAL_NZ via ``npu_format_cast(w.view(int8), 29, customize_dtype=int8)``,
  coarse scales transposed to ``(K/512, N)``, fine scales ``(N, K/64, 2)``, then
  ``npu_dual_level_quant_matmul``. K is zero-padded to whole 512-chunks (weights, scales and
  activations), the complete groups upstream documents as required.

Memory: the NZ weight replaces the ``weight`` parameter's storage (same logical shape, int8) so no
packed copy stays on the device; ``state_dict()`` converts it back with ``npu_format_cast(w, 2)``
(:func:`~.base.adopt_weight_storage`). A row-parallel shard that needs K padding keeps its packed
parameter and holds the padded NZ copy in a buffer.

torch_npu is imported when the backend is built, never at package import. No device is named:
every tensor is made on the device of the layer's own tensors.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import torch
import torch.nn.functional as F

from ..formats import (
    DUAL_BLOCK_SIZE,
    MX_BLOCK_SIZE,
    UOS_DST_TYPE_MAX,
    from_npu_scale_layout,
    to_npu_scale_layout,
)
from .base import (
    MxBackend,
    MxLayerSpec,
    adopt_weight_storage,
    padded_weight,
    restore_checkpoint_weight,
    set_buffer,
)

logger = logging.getLogger(__name__)

#: ``npu_dynamic_mx_quant`` arguments of each A4 scale rule (research/kernels.md §2.2).
SCALE_ALG_KWARGS: dict[str, dict[str, float]] = {
    "floor": {"scale_alg": 0},
    "uos": {"scale_alg": 2, "dst_type_max": UOS_DST_TYPE_MAX},
}
A4_GROUP_SIZES = [1, 1, 32]
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


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class NpuBackend(MxBackend):
    """MXFP4 Linears on Ascend 950 through torch_npu's MX quantizers and quantized matmuls."""

    name = "npu"

    def __init__(self) -> None:
        self.npu = import_torch_npu()

    def describe(self) -> str:
        version = getattr(self.npu, "__version__", "unknown version")
        return f"npu (torch_npu {version}; NZ weights adopted in place for mxfp4_dualscale)"

    # ------------------------------------------------------------------ quantizers

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
            block_size=MX_BLOCK_SIZE,
            **SCALE_ALG_KWARGS[scale_rule],
        )

    def _mx8_quant(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.npu.npu_dynamic_mx_quant(
            x, axis=-1, round_mode="rint", dst_type=torch.float8_e4m3fn, block_size=MX_BLOCK_SIZE, scale_alg=0
        )

    def quantize_weight(self, weight: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
        data, scale = self._mx_quant(weight, scale_rule)
        groups = -(-weight.shape[-1] // MX_BLOCK_SIZE)
        return _as_uint8(data), from_npu_scale_layout(_as_uint8(scale), groups).contiguous()

    def quantize_weight_dualscale(
        self, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if weight.dtype not in (torch.bfloat16, torch.float16):
            weight = weight.to(torch.bfloat16)  # the dual-level quantizer takes bf16/fp16 only
        data, level0, level1 = self.npu.npu_dynamic_dual_level_mx_quant(
            weight, smooth_scale=None, round_mode="rint"
        )
        groups = -(-weight.shape[-1] // MX_BLOCK_SIZE)
        return _as_uint8(data), from_npu_scale_layout(_as_uint8(level1), groups).contiguous(), level0

    # ------------------------------------------------------------------ preparation

    def prepare(self, layer: torch.nn.Module, spec: MxLayerSpec) -> None:
        restore_checkpoint_weight(layer)
        if spec.dual_scale:
            self._prepare_dual(layer, spec)
        else:
            self._prepare_single(layer, spec)

    def _prepare_single(self, layer: torch.nn.Module, spec: MxLayerSpec) -> None:
        k_total = spec.k_pad_front + spec.in_features + spec.k_pad_back
        scale = _checked_scale(layer.weight_scale, spec, -(-k_total // MX_BLOCK_SIZE))
        padded = spec.k_pad_front or spec.k_pad_back
        set_buffer(layer, "_mx_npu_weight", padded_weight(layer, spec) if padded else None)
        set_buffer(layer, "_mx_npu_scale", to_npu_scale_layout(scale).contiguous())

    def _prepare_dual(self, layer: torch.nn.Module, spec: MxLayerSpec) -> None:
        k_total = spec.k_pad_front + spec.in_features + spec.k_pad_back
        k_chunks = _round_up(k_total, DUAL_BLOCK_SIZE)
        extra = k_chunks - k_total  # whole 512-chunks for the dual-level GEMM
        scale = _checked_scale(layer.weight_scale, spec, -(-k_total // MX_BLOCK_SIZE))
        scale = F.pad(scale, (0, k_chunks // MX_BLOCK_SIZE - scale.shape[-1]))
        dual = layer.weight_dual_scale
        chunks = k_chunks // DUAL_BLOCK_SIZE
        if dual.dim() == 3 and dual.shape[-1] == 1:
            dual = dual.squeeze(-1)
        if tuple(dual.shape) != (spec.out_features, chunks):
            raise ValueError(
                f"{spec.prefix}.weight_dual_scale: expected float32 (N, {chunks}, 1) = "
                f"({spec.out_features}, {chunks}, 1), got {tuple(layer.weight_dual_scale.shape)}"
            )
        weight = padded_weight(layer, spec)
        if extra:
            weight = F.pad(weight, (0, extra // 2))
        nz = self.npu.npu_format_cast(
            weight.contiguous().view(torch.int8), ACL_FORMAT_FRACTAL_NZ, customize_dtype=torch.int8
        )
        if spec.k_pad_front or spec.k_pad_back or extra:
            set_buffer(layer, "_mx_npu_weight", nz)
        else:
            adopt_weight_storage(layer, nz, self._nz_to_checkpoint)
            set_buffer(layer, "_mx_npu_weight", None)
        set_buffer(layer, "_mx_npu_scale", to_npu_scale_layout(scale).contiguous())
        set_buffer(layer, "_mx_npu_dual_t", dual.float().transpose(0, 1).contiguous())
        layer._mx_npu_k_extra = extra

    def _nz_to_checkpoint(self, nz: torch.Tensor) -> torch.Tensor:
        return self.npu.npu_format_cast(nz, ACL_FORMAT_ND).view(torch.uint8)

    # ------------------------------------------------------------------ forward

    def linear(
        self,
        layer: torch.nn.Module,
        spec: MxLayerSpec,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        a8: bool,
    ) -> torch.Tensor:
        if spec.dual_scale:
            if a8:
                raise ValueError(f"{spec.prefix}: mxfp4_dualscale has no W4A8 route")
            return self._linear_dual(layer, spec, x, bias)
        out_dtype = x.dtype
        if spec.has_smooth:
            x = x * layer._mx_smooth.to(x.dtype)
        if spec.k_pad_front or spec.k_pad_back:
            x = F.pad(x, (spec.k_pad_front, spec.k_pad_back))
        weight = layer._buffers.get("_mx_npu_weight")
        if weight is None:
            weight = layer.weight
        scale = layer._mx_npu_scale
        e8m0 = self.npu.float8_e8m0fnu
        if a8:
            x_q, x_scale = self._mx8_quant(x)
            out = self.npu.npu_quant_matmul(
                x_q,
                weight.transpose(0, 1),
                scale.transpose(0, 1),
                scale_dtype=e8m0,
                pertoken_scale=x_scale,
                pertoken_scale_dtype=e8m0,
                bias=None if bias is None else bias.to(torch.bfloat16).reshape(1, -1),
                output_dtype=torch.bfloat16,
                x2_dtype=self.npu.float4_e2m1fn_x2,
                group_sizes=W4A8_GROUP_SIZES,
            )
            return out.to(out_dtype)
        x_q, x_scale = self._mx_quant(x, spec.act_scale_rule)
        fp4 = self.npu.float4_e2m1fn_x2
        return self.npu.npu_quant_matmul(
            x_q,
            weight.transpose(0, 1),
            scale.transpose(0, 1),
            scale_dtype=e8m0,
            pertoken_scale=x_scale,
            pertoken_scale_dtype=e8m0,
            bias=None if bias is None else bias.float(),
            output_dtype=out_dtype,
            x1_dtype=fp4,
            x2_dtype=fp4,
            group_sizes=A4_GROUP_SIZES,
        )

    def _linear_dual(
        self, layer: torch.nn.Module, spec: MxLayerSpec, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        out_dtype = x.dtype
        if x.dtype not in (torch.bfloat16, torch.float16):
            x = x.to(torch.bfloat16)
        smooth = layer._mx_smooth.to(x.dtype) if spec.has_smooth else None
        front, back = spec.k_pad_front, spec.k_pad_back + layer._mx_npu_k_extra
        if front or back:
            x = F.pad(x, (front, back))
            if smooth is not None:
                smooth = F.pad(smooth, (front, back), value=1.0)
        x_q, x_level0, x_level1 = self.npu.npu_dynamic_dual_level_mx_quant(
            x, smooth_scale=smooth, round_mode="rint"
        )
        weight = layer._buffers.get("_mx_npu_weight")
        if weight is None:
            weight = layer.weight
        out = self.npu.npu_dual_level_quant_matmul(
            x_q,
            weight,
            x_level0,
            layer._mx_npu_dual_t,
            x_level1,
            layer._mx_npu_scale,
            bias=None if bias is None else bias.float().contiguous(),
            output_dtype=x.dtype,
        )
        return out.to(out_dtype)


def _as_uint8(t: torch.Tensor) -> torch.Tensor:
    """torch_npu returns FP4 / E8M0 bytes as uint8 (int8 on some builds): the canonical uint8 view."""
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _checked_scale(scale: torch.Tensor, spec: MxLayerSpec, groups: int) -> torch.Tensor:
    if scale.dtype != torch.uint8 or tuple(scale.shape) != (spec.out_features, groups):
        raise ValueError(
            f"{spec.prefix}.weight_scale: expected uint8 E8M0 codes (N, {groups}) = ({spec.out_features}, "
            f"{groups}), got {scale.dtype} {tuple(scale.shape)}"
        )
    return scale
