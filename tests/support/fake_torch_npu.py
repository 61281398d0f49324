"""A semantic fake of the torch_npu MX ops the NPU kernels call, built on the project's formats core.

Each op checks its documented contract (docs/kernels.md, the torch_npu / aclnn docs) and
computes its documented result from the formats core, so a wrong argument, layout, transpose,
padding or scale rule either raises here or changes the numbers:

- ``npu_dynamic_mx_quant``: keyword-only arguments; bf16/fp16/fp32 input (fp32 only with blocks of
  32 and K >= 32); FP4 E2M1 (296) or torch.float8_e4m3fn output along the last axis; round mode
  per type ("rint" is the one modelled); ``scale_alg`` 0 = FLOOR, 2 = FP4 only, ``dst_type_max``
  7.25 = UOS (0/6/7 are the bf16 add-and-mask rules the project never uses: not modelled, raise);
  ``dst_type_max`` is ignored by scale_alg 0, as the kernel does; ``max_low_bound`` must be 0 unless
  scale_alg 1. Output: packed uint8 (..., K/2) or fp8 (..., K), scales uint8 (..., ceil(G/2), 2)
  with an odd G zero-padded.
- ``npu_quant_matmul`` (MX modes only): transposition of x2 and of its scale is read from strides
  (a ``transpose(0, 1)`` view of contiguous storage), packed FP4 needs ``x*_dtype`` = 296, the
  packed dim is the contiguous one; shapes are checked against the logical (m, k) x (k, n);
  scales are E8M0 ``(m, ceil(k/64), 2)`` and ``(ceil(k/64), n, 2)``; FP4 x FP4 needs group sizes
  [1, 1, 32] and a float32 bias (n,); FP8 x FP4 (W4A8) needs a transposed x2, k % 8 == 0, group
  sizes [0, 0, 32] or [1, 1, 32], and a bf16/fp16 bias (1, n) of the output dtype; FP8 x FP8 (MXFP8
  W8A8: native float8_e4m3fn operands, ``x*_dtype`` absent or E4M3) needs group sizes [1, 1, 32], a
  float32 bias (n,) and an fp16/bf16/fp32 output; FP4 x FP8 has no mode. Result:
  dequantized operands (E8M0 0 -> 2^-127, 0xFF -> NaN) multiplied in float32, plus bias, in
  ``output_dtype``.
- ``npu_format_cast``: ND <-> FRACTAL_NZ (29). NZ needs a contiguous 2-D int8 ND tensor and
  ``customize_dtype=torch.int8`` (FP4 goes through its int8 view). The NZ result is a new storage
  remembered with its exact (shape, stride, offset, dtype): an opaque tag. Any later view,
  reshape, slice or dtype view of it no longer matches and is refused by every op here; an NZ
  tensor passed where ND is expected is refused too.
- ``npu_dynamic_dual_level_mx_quant``: bf16/fp16 input, even K, optional Smooth (K,) of the input's
  dtype, "rint"; returns packed data, float32 level-0 (..., ceil(K/512)) and level-1 scales in the
  pair layout.
- ``npu_dual_level_quant_matmul``: every tensor contiguous ND except x2, which must be an NZ
  tensor; x1 (m, k/2), x2 (n, k/2), level-0 scales (m, C) and transposed (C, n), level-1 scales
  (m, ceil(k/64), 2) and (n, ceil(k/64), 2); float32 bias (n,); fp16/bf16 output.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from vllm_omni_mxfp4.formats import (
    DUAL_BLOCK_SIZE,
    MX_BLOCK_SIZE,
    UOS_DST_TYPE_MAX,
    dequantize_dualscale,
    dequantize_mx,
    e2m1_decode,
    e8m0_to_float,
    from_npu_scale_layout,
    quantize_dualscale,
    quantize_mx,
    to_npu_scale_layout,
    unpack_fp4,
)

FLOAT4_E2M1 = 296
FLOAT4_E1M2 = 297
FLOAT8_E8M0 = 293
HIFLOAT8 = 290
ACL_ND = 2
ACL_FRACTAL_NZ = 29


class FakeNpuError(ValueError):
    """A call the real kernel would reject (or compute something else for)."""


def _signature(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _e8m0(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype == torch.float8_e8m0fnu:
        t = t.view(torch.uint8)
    if t.dtype != torch.uint8:
        raise FakeNpuError(f"{name}: E8M0 scales must be uint8 / float8_e8m0fnu bytes, got {t.dtype}")
    return t


def _is_fp8_e4m3(dst_type) -> bool:
    return dst_type is torch.float8_e4m3fn or dst_type == 292


def _pairs_to_codes(pairs: torch.Tensor, groups: int, name: str) -> torch.Tensor:
    """(rows, ceil(G/2), 2) -> (rows, G), checking the shape."""
    want = -(-groups // 2)
    if pairs.dim() != 3 or pairs.shape[1] != want or pairs.shape[2] != 2:
        raise FakeNpuError(
            f"{name}: expected E8M0 pairs (rows, {want}, 2) for {groups} groups, got {tuple(pairs.shape)}"
        )
    return from_npu_scale_layout(pairs.contiguous(), groups)


class FakeTorchNpu(types.ModuleType):
    """The ``torch_npu`` module as the NPU backend sees it; ``calls`` records (op, args, kwargs)."""

    float4_e2m1fn_x2 = FLOAT4_E2M1
    float4_e1m2fn_x2 = FLOAT4_E1M2
    float8_e8m0fnu = FLOAT8_E8M0
    hifloat8 = HIFLOAT8
    __version__ = "fake-2.13"

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self._nz: dict[int, tuple] = {}
        self.calls: list[tuple[str, tuple, dict]] = []

    # ------------------------------------------------------------------ NZ bookkeeping

    def is_nz(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is exactly a FRACTAL_NZ tensor made by npu_format_cast (not a view of one)."""
        return self._nz.get(t.untyped_storage().data_ptr()) == _signature(t)

    def _nd(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """Refuse NZ tensors and views of them where an ND tensor is expected."""
        sig = self._nz.get(t.untyped_storage().data_ptr())
        if sig is not None:
            if sig == _signature(t):
                raise FakeNpuError(f"{name}: got a FRACTAL_NZ tensor where the op takes ND")
            raise FakeNpuError(
                f"{name}: a view/reshape/slice of a FRACTAL_NZ tensor (NZ tensors must not be modified after "
                "npu_format_cast)"
            )
        return t

    # ------------------------------------------------------------------ ops

    def npu_format_cast(self, input: torch.Tensor, acl_format: int, customize_dtype=None) -> torch.Tensor:
        self.calls.append(("npu_format_cast", (input, acl_format), {"customize_dtype": customize_dtype}))
        if acl_format == ACL_ND:
            if not self.is_nz(input):
                self._nd(input, "npu_format_cast(input)")
            return input.clone()
        if acl_format != ACL_FRACTAL_NZ:
            raise NotImplementedError(
                f"fake npu_format_cast models ND (2) and FRACTAL_NZ (29), not {acl_format}"
            )
        self._nd(input, "npu_format_cast(input)")
        if input.dim() != 2 or not input.is_contiguous():
            raise FakeNpuError(
                f"npu_format_cast to NZ: expected a contiguous 2-D tensor, got {tuple(input.shape)}"
            )
        if input.dtype != torch.int8 or customize_dtype is not torch.int8:
            raise FakeNpuError(
                "npu_format_cast to NZ of FP4 weights: pass the int8 view with customize_dtype=torch.int8 "
                f"(FP4 has no NZ cast of its own); got {input.dtype}, customize_dtype={customize_dtype}"
            )
        out = input.clone()
        self._nz[out.untyped_storage().data_ptr()] = _signature(out)
        return out

    def npu_dynamic_mx_quant(
        self,
        input: torch.Tensor,
        *,
        axis: int = -1,
        round_mode: str = "rint",
        dst_type=FLOAT4_E2M1,
        block_size: int = 32,
        scale_alg: int | None = 0,
        dst_type_max: float = 0.0,
        max_low_bound: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(
            (
                "npu_dynamic_mx_quant",
                (input,),
                dict(
                    axis=axis,
                    round_mode=round_mode,
                    dst_type=dst_type,
                    block_size=block_size,
                    scale_alg=scale_alg,
                    dst_type_max=dst_type_max,
                    max_low_bound=max_low_bound,
                ),
            )
        )
        self._nd(input, "npu_dynamic_mx_quant(input)")
        elem = _mx_quant_element(input, axis=axis, round_mode=round_mode, dst_type=dst_type)
        rule = _mx_quant_rule(
            input,
            elem,
            block_size=block_size,
            scale_alg=scale_alg,
            dst_type_max=dst_type_max,
            max_low_bound=max_low_bound,
        )
        data, codes = quantize_mx(input, elem=elem, scale_rule=rule)
        return data, to_npu_scale_layout(codes)

    def npu_quant_matmul(
        self,
        x1: torch.Tensor,
        x2: torch.Tensor,
        scale: torch.Tensor,
        *,
        offset=None,
        pertoken_scale=None,
        bias=None,
        output_dtype=None,
        x1_dtype=None,
        x2_dtype=None,
        pertoken_scale_dtype=None,
        scale_dtype=None,
        group_sizes=None,
        y_scale=None,
    ) -> torch.Tensor:
        kwargs = dict(
            offset=offset,
            pertoken_scale=pertoken_scale,
            bias=bias,
            output_dtype=output_dtype,
            x1_dtype=x1_dtype,
            x2_dtype=x2_dtype,
            pertoken_scale_dtype=pertoken_scale_dtype,
            scale_dtype=scale_dtype,
            group_sizes=group_sizes,
            y_scale=y_scale,
        )
        self.calls.append(("npu_quant_matmul", (x1, x2, scale), kwargs))
        for name, t in (
            ("x1", x1),
            ("x2", x2),
            ("scale", scale),
            ("pertoken_scale", pertoken_scale),
            ("bias", bias),
        ):
            if t is not None:
                self._nd(t, f"npu_quant_matmul({name})")
        _check_mx_mode(offset, y_scale, scale_dtype, pertoken_scale, pertoken_scale_dtype)
        x1_fp4, m, k = _read_x1(x1, x1_dtype)
        x2_t, n, w_vals = _read_x2(x2, x2_dtype, k)
        x_codes, w_codes = _read_scales(pertoken_scale, scale, m, n, k, x2_t)
        w_deq = w_vals * e8m0_to_float(w_codes).repeat_interleave(MX_BLOCK_SIZE, dim=-1)[:, :k]
        x_deq = dequantize_mx(x1, x_codes, elem="fp4" if x1_fp4 else "fp8", dtype=torch.float32)
        if x2.dtype == torch.float8_e4m3fn:
            b = _mxfp8_mode_bias(x1_fp4, n, group_sizes, output_dtype, bias)
        else:
            b = _mode_bias(x1_fp4, x2_t, k, n, group_sizes, output_dtype, bias)
        return F.linear(x_deq, w_deq, None if b is None else b.float()).to(output_dtype)

    def npu_dynamic_dual_level_mx_quant(
        self, input: torch.Tensor, *, smooth_scale: torch.Tensor | None = None, round_mode: str = "rint"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.calls.append(
            (
                "npu_dynamic_dual_level_mx_quant",
                (input,),
                {"smooth_scale": smooth_scale, "round_mode": round_mode},
            )
        )
        self._nd(input, "npu_dynamic_dual_level_mx_quant(input)")
        if input.dtype not in (torch.bfloat16, torch.float16):
            raise FakeNpuError(f"npu_dynamic_dual_level_mx_quant: input must be bf16/fp16, got {input.dtype}")
        k = input.shape[-1]
        if k % 2:
            raise FakeNpuError(f"npu_dynamic_dual_level_mx_quant: the last dim must be even, got {k}")
        if smooth_scale is not None:
            self._nd(smooth_scale, "npu_dynamic_dual_level_mx_quant(smooth_scale)")
            if smooth_scale.dtype != input.dtype or tuple(smooth_scale.shape) != (k,):
                raise FakeNpuError(
                    f"npu_dynamic_dual_level_mx_quant: smooth_scale must be ({k},) of the input's dtype "
                    f"{input.dtype}, got {smooth_scale.dtype} {tuple(smooth_scale.shape)}"
                )
        if round_mode != "rint":
            raise NotImplementedError(
                f"fake npu_dynamic_dual_level_mx_quant models 'rint' only, got {round_mode!r}"
            )
        data, codes, level0 = quantize_dualscale(input, smooth=smooth_scale)
        return data, level0, to_npu_scale_layout(codes)

    def npu_dual_level_quant_matmul(
        self,
        x1: torch.Tensor,
        x2: torch.Tensor,
        x1_level0_scale: torch.Tensor,
        x2_level0_scale: torch.Tensor,
        x1_level1_scale: torch.Tensor,
        x2_level1_scale: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        output_dtype=torch.bfloat16,
    ) -> torch.Tensor:
        self.calls.append(
            (
                "npu_dual_level_quant_matmul",
                (x1, x2, x1_level0_scale, x2_level0_scale, x1_level1_scale, x2_level1_scale),
                {"bias": bias, "output_dtype": output_dtype},
            )
        )
        if not self.is_nz(x2):
            self._nd(x2, "npu_dual_level_quant_matmul(x2)")
            raise FakeNpuError(
                "npu_dual_level_quant_matmul: x2 must be FRACTAL_NZ (npu_format_cast(w.view(int8), 29, "
                "customize_dtype=torch.int8))"
            )
        named = (
            ("x1", x1),
            ("x1_level0_scale", x1_level0_scale),
            ("x2_level0_scale", x2_level0_scale),
            ("x1_level1_scale", x1_level1_scale),
            ("x2_level1_scale", x2_level1_scale),
            ("bias", bias),
        )
        for name, t in named:
            if t is not None:
                self._nd(t, f"npu_dual_level_quant_matmul({name})")
                if not t.is_contiguous():
                    raise FakeNpuError(f"npu_dual_level_quant_matmul: {name} must be contiguous")
        m, n, groups = _dual_level_shapes(x1, x2, x1_level0_scale, x2_level0_scale)
        x1_codes = _pairs_to_codes(_e8m0(x1_level1_scale, "x1_level1_scale"), groups, "x1_level1_scale")
        x2_codes = _pairs_to_codes(_e8m0(x2_level1_scale, "x2_level1_scale"), groups, "x2_level1_scale")
        if x1_codes.shape[0] != m or x2_codes.shape[0] != n:
            raise FakeNpuError("npu_dual_level_quant_matmul: level-1 scales must have m / n rows")
        if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
            raise FakeNpuError(
                f"npu_dual_level_quant_matmul: bias must be float32 ({n},), got {bias.dtype} "
                f"{tuple(bias.shape)}"
            )
        if output_dtype not in (torch.float16, torch.bfloat16):
            raise FakeNpuError(
                f"npu_dual_level_quant_matmul: output_dtype must be fp16/bf16, got {output_dtype}"
            )
        a = dequantize_dualscale(x1, x1_codes, x1_level0_scale)
        w = dequantize_dualscale(x2.view(torch.uint8), x2_codes, x2_level0_scale.transpose(0, 1))
        return F.linear(a, w, bias).to(output_dtype)


def _dual_level_shapes(
    x1: torch.Tensor, x2: torch.Tensor, x1_level0_scale: torch.Tensor, x2_level0_scale: torch.Tensor
) -> tuple[int, int, int]:
    """npu_dual_level_quant_matmul's operand and level-0 shapes: (m, n, scale groups)."""
    if x1.dtype != torch.uint8 or x1.dim() != 2:
        raise FakeNpuError(
            f"npu_dual_level_quant_matmul: x1 must be packed FP4 uint8 (m, k/2), got {x1.dtype} "
            f"{tuple(x1.shape)}"
        )
    m, k = x1.shape[0], x1.shape[1] * 2
    if x2.dim() != 2 or x2.shape[1] * 2 != k:
        raise FakeNpuError(
            f"npu_dual_level_quant_matmul: x2 must be (n, k/2) with k={k}, got {tuple(x2.shape)}"
        )
    n = x2.shape[0]
    chunks, groups = -(-k // DUAL_BLOCK_SIZE), -(-k // MX_BLOCK_SIZE)
    for name, t, shape in (
        ("x1_level0_scale", x1_level0_scale, (m, chunks)),
        ("x2_level0_scale", x2_level0_scale, (chunks, n)),
    ):
        if t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise FakeNpuError(
                f"npu_dual_level_quant_matmul: {name} must be float32 {shape}, got {t.dtype} {tuple(t.shape)}"
            )
    return m, n, groups


def _mx_quant_element(input: torch.Tensor, *, axis: int, round_mode: str, dst_type) -> str:
    """npu_dynamic_mx_quant's input and output-type rules; the element type ("fp4" or "fp8")."""
    if input.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise FakeNpuError(f"npu_dynamic_mx_quant: input must be fp16/bf16/fp32, got {input.dtype}")
    if not 1 <= input.dim() <= 7:
        raise FakeNpuError(f"npu_dynamic_mx_quant: input must have 1-7 dims, got {input.dim()}")
    if axis not in (-1, input.dim() - 1):
        raise NotImplementedError("fake npu_dynamic_mx_quant models the tail axis only")
    if dst_type == FLOAT4_E2M1:
        elem = "fp4"
        if round_mode not in ("rint", "round", "floor"):
            raise FakeNpuError(
                f"npu_dynamic_mx_quant: FP4 round_mode must be rint/round/floor, got {round_mode!r}"
            )
        if input.shape[-1] % 2:
            raise FakeNpuError("npu_dynamic_mx_quant: FP4 output needs an even last dim")
    elif _is_fp8_e4m3(dst_type):
        elem = "fp8"
        if round_mode != "rint":
            raise FakeNpuError(
                f"npu_dynamic_mx_quant: FP8 accepts round_mode 'rint' only, got {round_mode!r}"
            )
    else:
        raise NotImplementedError(
            f"fake npu_dynamic_mx_quant models FP4 E2M1 (296) and float8_e4m3fn, not {dst_type}"
        )
    if round_mode != "rint":
        raise NotImplementedError(
            f"fake npu_dynamic_mx_quant models round_mode 'rint' only, got {round_mode!r}"
        )
    return elem


def _mx_quant_rule(
    input: torch.Tensor, elem: str, *, block_size: int, scale_alg, dst_type_max: float, max_low_bound: float
) -> str:
    """npu_dynamic_mx_quant's block and scale-algorithm rules; the formats core's scale rule."""
    if block_size % 32 or not 32 <= block_size <= 1024:
        raise FakeNpuError(
            f"npu_dynamic_mx_quant: block_size must be a multiple of 32 up to 1024, got {block_size}"
        )
    if block_size != 32:
        raise NotImplementedError("fake npu_dynamic_mx_quant models block_size 32 only")
    if input.dtype == torch.float32 and input.shape[-1] < 32:
        raise FakeNpuError("npu_dynamic_mx_quant: float32 input needs a quantized axis of at least 32")
    if max_low_bound != 0.0 and scale_alg != 1:
        raise FakeNpuError("npu_dynamic_mx_quant: max_low_bound must be 0.0 unless scale_alg=1")
    if dst_type_max != 0.0 and (elem != "fp4" or not 6.0 <= dst_type_max <= 12.0):
        raise FakeNpuError(
            f"npu_dynamic_mx_quant: dst_type_max must be 0.0 or in [6, 12], and only for FP4 E2M1; got "
            f"{dst_type_max} for {elem}"
        )
    if scale_alg == 0:
        rule = "floor"  # dst_type_max plays no part in scenario 1 (OCP)
    elif scale_alg == 2:
        if elem != "fp4":
            raise FakeNpuError("npu_dynamic_mx_quant: scale_alg=2 is for FP4 E2M1 only")
        if dst_type_max != UOS_DST_TYPE_MAX:
            raise NotImplementedError(
                f"fake npu_dynamic_mx_quant models scale_alg=2 with dst_type_max={UOS_DST_TYPE_MAX} (UOS) only, "
                f"got {dst_type_max}"
            )
        rule = "uos"
    elif scale_alg == 1:
        if elem != "fp8":
            raise FakeNpuError("npu_dynamic_mx_quant: scale_alg=1 (cuBLAS RCEIL) is for FP8 only")
        raise NotImplementedError("fake npu_dynamic_mx_quant does not model scale_alg=1")
    else:
        raise FakeNpuError(f"npu_dynamic_mx_quant: scale_alg must be 0, 1 or 2, got {scale_alg}")
    return rule


def _check_mx_mode(offset, y_scale, scale_dtype, pertoken_scale, pertoken_scale_dtype) -> None:
    """npu_quant_matmul: only the MX modes, with E8M0 scales on both sides."""
    if offset is not None or y_scale is not None:
        raise NotImplementedError("fake npu_quant_matmul models the MX modes (no offset / y_scale)")
    if (
        scale_dtype not in (FLOAT8_E8M0, torch.float8_e8m0fnu)
        or pertoken_scale is None
        or (pertoken_scale_dtype not in (FLOAT8_E8M0, torch.float8_e8m0fnu))
    ):
        raise FakeNpuError(
            "npu_quant_matmul MX mode: scale and pertoken_scale must be E8M0 with scale_dtype and "
            "pertoken_scale_dtype = float8_e8m0fnu"
        )


def _read_x1(x1: torch.Tensor, x1_dtype) -> tuple[bool, int, int]:
    """npu_quant_matmul's x1: (is FP4, m, k)."""
    # x1: (m, k), plain; FP4 is packed uint8 (m, k/2) with x1_dtype, FP8 is native.
    if x1.dim() != 2 or not x1.is_contiguous():
        raise FakeNpuError(
            f"npu_quant_matmul: x1 must be a contiguous 2-D (m, k) tensor, got {tuple(x1.shape)} "
            f"strides {x1.stride()}"
        )
    if x1.dtype == torch.uint8:
        if x1_dtype != FLOAT4_E2M1:
            raise FakeNpuError(
                "npu_quant_matmul: uint8 x1 holds packed FP4 only with x1_dtype=float4_e2m1fn_x2"
            )
        x1_fp4, (m, k) = True, (x1.shape[0], x1.shape[1] * 2)
    elif x1.dtype == torch.float8_e4m3fn:
        if x1_dtype not in (None, torch.float8_e4m3fn, 292):
            raise FakeNpuError(f"npu_quant_matmul: x1_dtype {x1_dtype} does not describe float8_e4m3fn x1")
        x1_fp4, (m, k) = False, tuple(x1.shape)
    else:
        raise NotImplementedError(f"fake npu_quant_matmul models FP4 / FP8 E4M3 x1, got {x1.dtype}")
    return x1_fp4, m, k


def _read_x2(x2: torch.Tensor, x2_dtype, k: int) -> tuple[bool, int, torch.Tensor]:
    """npu_quant_matmul's x2: (transposed, n, its E2M1 or E4M3 values (n, k))."""
    # x2: logical (k, n); a transpose(0, 1) view of contiguous (n, k) storage is "transposed".
    if x2.dtype == torch.float8_e4m3fn:
        return _read_fp8_x2(x2, x2_dtype, k)
    if x2.dim() != 2 or x2.dtype != torch.uint8 or x2_dtype != FLOAT4_E2M1:
        raise FakeNpuError(
            "npu_quant_matmul: x2 must be packed FP4 (uint8 with x2_dtype=float4_e2m1fn_x2), 2-D; got "
            f"{x2.dtype} {tuple(x2.shape)}, x2_dtype={x2_dtype}"
        )
    x2_t = x2.transpose(0, 1).is_contiguous() and not x2.is_contiguous()
    if not (x2_t or x2.is_contiguous()):
        raise FakeNpuError(
            f"npu_quant_matmul: x2 strides {x2.stride()} are neither plain nor a transposed view"
        )
    if x2_t:  # storage (n, k/2), packed along k
        k2, n = x2.shape[0] * 2, x2.shape[1]
        w_vals = e2m1_decode(unpack_fp4(x2.transpose(0, 1)))  # (n, k)
    else:  # storage (k, n/2), packed along n
        k2, n = x2.shape[0], x2.shape[1] * 2
        w_vals = e2m1_decode(unpack_fp4(x2)).transpose(0, 1)  # (n, k)
    if k2 != k:
        raise FakeNpuError(
            f"npu_quant_matmul: x1 has k={k} but x2 (read as {'(n, k)' if x2_t else '(k, n)'}) has k={k2}"
        )
    if k <= 2 or k % 2:
        raise FakeNpuError(f"npu_quant_matmul: FP4 needs an even k > 2, got {k}")
    return x2_t, n, w_vals


def _read_fp8_x2(x2: torch.Tensor, x2_dtype, k: int) -> tuple[bool, int, torch.Tensor]:
    """A native float8_e4m3fn x2 (MXFP8): (transposed, n, its values (n, k)); NaN codes stay NaN."""
    if x2.dim() != 2 or x2_dtype not in (None, torch.float8_e4m3fn, 292):
        raise FakeNpuError(
            f"npu_quant_matmul: float8_e4m3fn x2 must be 2-D with x2_dtype absent or E4M3, got "
            f"{tuple(x2.shape)}, x2_dtype={x2_dtype}"
        )
    x2_t = x2.transpose(0, 1).is_contiguous() and not x2.is_contiguous()
    if not (x2_t or x2.is_contiguous()):
        raise FakeNpuError(
            f"npu_quant_matmul: x2 strides {x2.stride()} are neither plain nor a transposed view"
        )
    values = x2.float()  # logical (k, n)
    if values.shape[0] != k:
        raise FakeNpuError(f"npu_quant_matmul: x1 has k={k} but x2 (k, n) has k={values.shape[0]}")
    return x2_t, values.shape[1], values.transpose(0, 1)


def _mxfp8_mode_bias(x1_fp4: bool, n: int, group_sizes, output_dtype, bias):
    """npu_quant_matmul's MX FP8 x FP8 mode rules (W8A8); the bias (n,) or None."""
    if x1_fp4:
        raise FakeNpuError("npu_quant_matmul: FP4 x1 with FP8 x2 is no MX mode (x1 FP8 needs x2 FP8 or FP4)")
    if list(group_sizes or []) != [1, 1, 32]:
        raise FakeNpuError(f"npu_quant_matmul: MX FP8 x FP8 needs group_sizes [1, 1, 32], got {group_sizes}")
    if output_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise FakeNpuError(f"npu_quant_matmul: output_dtype must be fp16/bf16/fp32, got {output_dtype}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
        raise FakeNpuError(
            f"npu_quant_matmul: MX bias must be float32 (n,) = ({n},), got {bias.dtype} {tuple(bias.shape)}"
        )
    return bias


def _read_scales(
    pertoken_scale, scale, m: int, n: int, k: int, x2_t: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """npu_quant_matmul's E8M0 pair layouts: (x1 codes (m, G), x2 codes (n, G))."""
    groups = -(-k // MX_BLOCK_SIZE)
    pairs = -(-groups // 2)
    pts = _e8m0(pertoken_scale, "pertoken_scale")
    if tuple(pts.shape) != (m, pairs, 2) or not pts.is_contiguous():
        raise FakeNpuError(
            f"npu_quant_matmul: pertoken_scale must be contiguous (m, ceil(k/64), 2) = "
            f"{(m, pairs, 2)}, got {tuple(pts.shape)}"
        )
    sc = _e8m0(scale, "scale")
    if tuple(sc.shape) != (pairs, n, 2):
        raise FakeNpuError(
            f"npu_quant_matmul: scale must be (ceil(k/64), n, 2) = {(pairs, n, 2)} (a transposed "
            f"view of (n, ceil(k/64), 2)), got {tuple(sc.shape)}"
        )
    # (A dim of size 1 makes both readings valid: then either layout fits.)
    if not (sc.transpose(0, 1).is_contiguous() if x2_t else sc.is_contiguous()):
        raise FakeNpuError("npu_quant_matmul: x2 and its scale must both be transposed views or both plain")
    w_codes = _pairs_to_codes(sc.transpose(0, 1), groups, "scale")  # (n, G)
    return _pairs_to_codes(pts, groups, "pertoken_scale"), w_codes


def _mode_bias(x1_fp4: bool, x2_t: bool, k: int, n: int, group_sizes, output_dtype, bias):
    """npu_quant_matmul's mode-specific rules (FP4 x FP4, or W4A8); the bias as a float (n,) or None."""
    if x1_fp4:
        if list(group_sizes or []) != [1, 1, 32]:
            raise FakeNpuError(
                f"npu_quant_matmul: MX FP4 x FP4 needs group_sizes [1, 1, 32], got {group_sizes}"
            )
        if output_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise FakeNpuError(f"npu_quant_matmul: output_dtype must be fp16/bf16/fp32, got {output_dtype}")
        if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
            raise FakeNpuError(
                f"npu_quant_matmul: MX bias must be float32 (n,) = ({n},), got {bias.dtype} "
                f"{tuple(bias.shape)}"
            )
        b = None if bias is None else bias
    else:
        if not x2_t:
            raise FakeNpuError("npu_quant_matmul: W4A8 (FP8 x FP4) takes x2 transposed only")
        if k % 8:
            raise FakeNpuError(f"npu_quant_matmul: W4A8 needs k % 8 == 0, got {k}")
        if list(group_sizes or []) not in ([0, 0, 32], [1, 1, 32]):
            raise FakeNpuError(
                f"npu_quant_matmul: W4A8 needs group_sizes [0, 0, 32] or [1, 1, 32], got {group_sizes}"
            )
        if output_dtype not in (torch.bfloat16, torch.float16):
            raise FakeNpuError(f"npu_quant_matmul: W4A8 writes bf16/fp16, got output_dtype={output_dtype}")
        if bias is not None and (bias.dtype != output_dtype or tuple(bias.shape) != (1, n)):
            raise FakeNpuError(
                f"npu_quant_matmul: W4A8 bias must be {output_dtype} (1, n) = (1, {n}), got "
                f"{bias.dtype} {tuple(bias.shape)}"
            )
        b = None if bias is None else bias.reshape(n)
    return b


def make_fake_torch_npu() -> FakeTorchNpu:
    """A fresh fake ``torch_npu`` module (its own NZ registry and call log)."""
    return FakeTorchNpu()


@contextlib.contextmanager
def fake_torch_npu_installed() -> Iterator[FakeTorchNpu]:
    """A fresh fake in ``sys.modules["torch_npu"]`` for the block, then removed again, so that the
    next job of the same process (a tensor-parallel rank running several) sees no NPU."""
    assert "torch_npu" not in sys.modules, "torch_npu is already imported in this process"
    fake = make_fake_torch_npu()
    sys.modules["torch_npu"] = fake
    try:
        yield fake
    finally:
        del sys.modules["torch_npu"]
