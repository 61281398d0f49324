"""E8M0 scales and the shared-exponent rules of each vendor kernel.

An E8M0 code ``c`` (uint8) stands for 2^(c - 127); 0xFF is NaN. Every stack picks ``c`` for a
block from the block's absolute maximum ``a`` differently (docs/kernels.md lists which kernel uses
which rule). Each rule below is a small pure function ``amax (float32) -> codes (int32)`` written
from the formulas of the kernels, using float32 bit fields so that it is exact:

=================  ==============================================  =========================
rule               formula (normal ``a``; E = floor(log2 a))         who
=================  ==============================================  =========================
``floor``          c = E - emax + 127; c = 0 when biased E <= emax   OCP MX, torch_npu scale_alg=0,
                   (and the block is then forced to zero)          dual-level level 1, torchao FLOOR
``uos``            S = fp32(a * fp32(1/7.25)); c = ceil-exponent(S)  torch_npu scale_alg=2,
                   (normal S only; subnormal S keeps its field 0)   dst_type_max=7.25 (FP4 only)
``even``           c = biased exponent of bits(a) + 0x200000 - emax  AITER Triton, Quark, torchao EVEN
                   (FP8 E4M3: + 0x80000); clamped at 0
``rceil``          S = fp32(a * fp32(1/max_elem)); c = ceil-exponent  NVIDIA, torchao RCEIL, AITER HIP
                   (subnormal S rounds up iff mantissa > 0.5)
``aiter_legacy``   a = max(a, 1e-10); c = E + [mant >= 0.5] - emax   older AITER HIP builds
=================  ==============================================  =========================

Non-finite ``a`` (a block holding Inf or NaN) gives 0xFF under every rule. An all-zero block gives
code 0 under every rule except ``aiter_legacy`` (92 for FP4, from its 1e-10 floor).

Which ``a`` the kernel sees depends on the input dtype; :func:`block_amax_for_rule` mirrors it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_omni_mxfp4 import spec

NAN_CODE = spec.E8M0_NAN
UOS_DST_TYPE_MAX = spec.UOS_DST_TYPE_MAX


@dataclass(frozen=True)
class ElemFormat:
    """An MX element format: its name, largest finite value and emax (floor(log2(max)))."""

    name: str
    max_value: float
    emax: int
    even_round_add: int  # float32 mantissa increment of the EVEN rule


FP4_E2M1 = ElemFormat("fp4", spec.E2M1_MAX, 2, 0x200000)
FP8_E4M3 = ElemFormat("fp8", spec.E4M3_MAX, 8, 0x80000)
ELEM_FORMATS: dict[str, ElemFormat] = {"fp4": FP4_E2M1, "fp8": FP8_E4M3}

SCALE_RULES: tuple[str, ...] = ("floor", "uos", "even", "rceil", "aiter_legacy")


def elem_format(elem: str) -> ElemFormat:
    """Look up an element format by name, with an error that lists the valid names."""
    try:
        return ELEM_FORMATS[elem]
    except KeyError:
        raise ValueError(f"elem must be one of {sorted(ELEM_FORMATS)}, got {elem!r}") from None


def check_rule(scale_rule: str, fmt: ElemFormat) -> None:
    """Reject unknown rules and rules a kernel does not define for this element format."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {list(SCALE_RULES)}, got {scale_rule!r}")
    if fmt is not FP4_E2M1 and scale_rule in ("uos", "aiter_legacy"):
        raise ValueError(f"scale_rule {scale_rule!r} is defined for elem='fp4' only, not elem={fmt.name!r}")


def _fields(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bits = a.view(torch.int32)
    return (bits >> 23) & 0xFF, bits & 0x7FFFFF


def _finalize(code: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(amax), code, torch.full_like(code, NAN_CODE))


def _ceil_exponent(s: torch.Tensor, subnormal_round_up: bool) -> torch.Tensor:
    e, m = _fields(s)
    up = (m != 0) & (e > 0) & (e < 254)
    code = e + up.to(torch.int32)
    if subnormal_round_up:
        code = torch.where((e == 0) & (m > 0x400000), torch.ones_like(code), code)
    return code


def codes_floor(amax: torch.Tensor, fmt: ElemFormat = FP4_E2M1) -> torch.Tensor:
    """OCP FLOOR: c = biased_exp(a) - emax, or 0 when that is <= 0 (NPU scale_alg=0)."""
    e, _ = _fields(amax)
    code = torch.where(e <= fmt.emax, torch.zeros_like(e), e - fmt.emax)
    return _finalize(code, amax)


def codes_uos(amax: torch.Tensor, fmt: ElemFormat = FP4_E2M1) -> torch.Tensor:
    """NPU scale_alg=2 with dst_type_max=7.25: round-up exponent of a * fp32(1/7.25)."""
    inv = torch.tensor(1.0 / UOS_DST_TYPE_MAX, dtype=torch.float32, device=amax.device)
    return _finalize(_ceil_exponent(amax * inv, subnormal_round_up=False), amax)


def codes_even(amax: torch.Tensor, fmt: ElemFormat = FP4_E2M1) -> torch.Tensor:
    """AITER Triton / Quark EVEN: add half an element-ulp to a's mantissa, keep the exponent."""
    bumped = amax.view(torch.int32) + fmt.even_round_add
    e = (bumped >> 23) & 0xFF
    return _finalize((e - fmt.emax).clamp_(min=0), amax)


def codes_rceil(amax: torch.Tensor, fmt: ElemFormat = FP4_E2M1) -> torch.Tensor:
    """NVIDIA RCEIL: round-up exponent of a * fp32(1/max_elem)."""
    inv = torch.tensor(1.0 / fmt.max_value, dtype=torch.float32, device=amax.device)
    return _finalize(_ceil_exponent(amax * inv, subnormal_round_up=True), amax)


def codes_aiter_legacy(amax: torch.Tensor, fmt: ElemFormat = FP4_E2M1) -> torch.Tensor:
    """Older AITER HIP per_1x32: round a to the nearest power of two (ties up), x 1/4."""
    floor = torch.tensor(1e-10, dtype=torch.float32, device=amax.device)
    a = torch.maximum(amax, floor)
    e, m = _fields(a)
    code = e + (m >= 0x400000).to(torch.int32) - fmt.emax
    return _finalize(code.clamp_(0, 254), amax)


_RULES = {
    "floor": codes_floor,
    "uos": codes_uos,
    "even": codes_even,
    "rceil": codes_rceil,
    "aiter_legacy": codes_aiter_legacy,
}


def shared_exponent_codes(amax: torch.Tensor, scale_rule: str, elem: str = "fp4") -> torch.Tensor:
    """E8M0 codes (int32) for float32 block maxima under ``scale_rule``."""
    fmt = elem_format(elem)
    check_rule(scale_rule, fmt)
    if amax.dtype != torch.float32:
        raise TypeError(f"shared_exponent_codes: amax must be float32, got {amax.dtype}")
    return _RULES[scale_rule](amax, fmt)


def block_amax_for_rule(amax: torch.Tensor, input_dtype: torch.dtype, scale_rule: str) -> torch.Tensor:
    """The float32 block maximum the kernel of ``scale_rule`` sees for ``input_dtype`` data.

    NPU scale_alg=2 (``uos``) takes the maximum as a bf16 value, so fp16 inputs are rounded to bf16
    (RINT) first; bf16 and fp32 maxima are used as they are. Every other rule sees the exact value
    (the NPU FLOOR path truncates fp16 to bf16, which keeps the exponent).
    """
    if scale_rule == "uos" and input_dtype == torch.float16:
        return amax.to(torch.bfloat16).float()
    return amax


def e8m0_to_float(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """2^(code - 127) for uint8 E8M0 codes; 0xFF -> NaN; code 0 -> 2^-127 (an fp32 subnormal)."""
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, torch.full_like(c, 0x00400000), c << 23)
    bits = torch.where(c == NAN_CODE, torch.full_like(c, 0x7FC00000), bits)
    return bits.view(torch.float32).to(dtype)


def recip_scale(codes: torch.Tensor, scale_rule: str) -> torch.Tensor:
    """float32 multiplier 2^(127 - code) that maps a block onto the element grid.

    Code 0 under ``floor`` gives 0: the NPU kernels zero such blocks (docs/kernels.md); every other
    rule divides by 2^-127 as usual. 0xFF gives NaN.
    """
    c = codes.to(torch.int32)
    exp_field = 254 - c  # biased exponent of 2^(127 - c)
    bits = torch.where(exp_field >= 1, exp_field << 23, torch.full_like(c, 0x00400000))
    bits = torch.where(c == NAN_CODE, torch.full_like(c, 0x7FC00000), bits)
    if scale_rule == "floor":
        bits = torch.where(c == 0, torch.zeros_like(c), bits)
    return bits.view(torch.float32)
