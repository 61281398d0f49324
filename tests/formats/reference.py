"""An independent, deliberately slow reference for MX quantization, written from docs/kernels.md.

Scalar Python/NumPy, float64 values and explicit float32 arithmetic where the kernels use it. It
shares no code with ``vllm_omni_mxfp4.formats``: a bug there cannot hide here.
"""

from __future__ import annotations

import math

import numpy as np

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: The value of each E2M1 code 0..15: sign in bit 3, so code 8 is -0.0. The one copy for all tests.
CODE_VALUES = (*GRID, *(-g for g in GRID))
EMAX = {"fp4": 2, "fp8": 8}
MAXV = {"fp4": 6.0, "fp8": 448.0}


def f32_fields(v: float) -> tuple[int, int]:
    bits = int(np.array([v], dtype=np.float32).view(np.uint32)[0])
    return (bits >> 23) & 0xFF, bits & 0x7FFFFF


def f32_mul(a: float, b: float) -> float:
    return float(np.float32(a) * np.float32(b))


def ceil_exponent(s: float, subnormal_up: bool) -> int:
    e, m = f32_fields(s)
    if e == 0:
        return 1 if (subnormal_up and m > 0x400000) else 0
    return e + (1 if (m != 0 and e < 254) else 0)


def scale_code(amax: float, rule: str, elem: str = "fp4") -> int:
    """E8M0 code of a block whose exact maximum magnitude is ``amax``."""
    if not math.isfinite(amax):
        return 255
    emax = EMAX[elem]
    if rule == "floor":
        e, _ = f32_fields(amax)
        return 0 if e <= emax else e - emax
    if rule == "uos":
        return ceil_exponent(f32_mul(amax, float(np.float32(1 / 7.25))), subnormal_up=False)
    if rule == "rceil":
        return ceil_exponent(f32_mul(amax, float(np.float32(1 / MAXV[elem]))), subnormal_up=True)
    if rule == "even":
        bits = int(np.array([amax], dtype=np.float32).view(np.uint32)[0])
        bits += 0x200000 if elem == "fp4" else 0x80000
        return max(((bits >> 23) & 0xFF) - emax, 0)
    if rule == "aiter_legacy":
        a = max(amax, float(np.float32(1e-10)))
        e, m = f32_fields(a)
        return min(max(e + (1 if m >= 0x400000 else 0) - emax, 0), 254)
    raise ValueError(rule)


def e2m1_code(y: float) -> int:
    """RNE onto the E2M1 grid with saturation, keeping the sign; NaN -> 0."""
    if math.isnan(y):
        return 0
    sign = 8 if math.copysign(1.0, y) < 0 else 0
    a = abs(y)
    if a >= 6.0:
        return sign | 7
    best = min(range(8), key=lambda i: (abs(GRID[i] - a), i % 2))
    return sign | best


def e4m3_grid() -> list[float]:
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return vals


_E4M3 = e4m3_grid()


def e4m3_value(y: float) -> float:
    """RNE onto the E4M3 grid with saturation to 448 (ties to even mantissa); NaN stays NaN."""
    if math.isnan(y):
        return math.nan
    a = min(abs(y), 448.0)
    best = min(range(len(_E4M3)), key=lambda i: (abs(_E4M3[i] - a), i % 2))
    return math.copysign(_E4M3[best], y)


def quantize_row(values: list[float], rule: str, elem: str = "fp4", block: int = 32, amax_bf16: bool = False):
    """Reference MX quantization of one row: (codes or fp8 values per element, scale codes).

    ``amax_bf16`` rounds the block maximum to bf16 before the rule sees it (NPU UOS on fp16 input).
    """
    k = len(values)
    out, scales = [], []
    for start in range(0, k, block):
        blk = values[start : start + block]
        amax = max((abs(v) for v in blk), default=0.0)
        if any(math.isnan(v) for v in blk):
            amax = math.nan
        elif amax_bf16:
            amax = bf16_round(amax)
        code = scale_code(amax, rule, elem)
        scales.append(code)
        for v in blk:
            if code == 255:
                out.append(0 if elem == "fp4" else math.nan)
                continue
            if rule == "floor" and code == 0:
                y = v * 0.0
            else:
                y = v * 2.0 ** (127 - code)
            out.append(e2m1_code(y) if elem == "fp4" else e4m3_value(y))
    return out, scales


def pack_row(codes: list[int]) -> list[int]:
    return [codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)]


def dequant_value(code: int, scale: int) -> float:
    if scale == 255:
        return math.nan
    mag = GRID[code & 7]
    val = mag * 2.0 ** (scale - 127)
    return -val if code & 8 else val


def bf16_round(v: float) -> float:
    """Round a float32-representable value to bfloat16, nearest-even, via float32 bit arithmetic."""
    bits = int(np.array([v], dtype=np.float32).view(np.uint32)[0])
    if (bits & 0x7F800000) == 0x7F800000:
        return (
            float(np.array([bits & 0xFFFF0000], dtype=np.uint32).view(np.float32)[0])
            if (bits & 0x7FFFFF) == 0
            else math.nan
        )
    lsb = (bits >> 16) & 1
    bits = (bits + 0x7FFF + lsb) & 0xFFFF0000
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def dualscale_row(values: list[float], smooth: list[float] | None = None):
    """Reference of torch_npu dual-level quantization (docs/kernels.md) for one bf16 row."""
    k = len(values)
    xs = [bf16_round(v * s) for v, s in zip(values, smooth)] if smooth is not None else list(values)
    codes, scales, l0s = [], [], []
    inv6 = float(np.float32(1 / 6))
    for c0 in range(0, k, 512):
        chunk = xs[c0 : c0 + 512]
        amax = max((abs(v) for v in chunk if math.isfinite(v)), default=0.0)
        l0 = f32_mul(amax, inv6)
        if l0 < 2.0**-126:
            l0 = 0.0
        l0s.append(l0)
        t = []
        for v in chunk:
            if v == 0:
                t.append(v)
            elif l0 == 0:
                t.append(math.copysign(math.inf, v) if not math.isnan(v) else math.nan)
            else:
                t.append(bf16_round(float(np.float32(v) / np.float32(l0))))
        c, s = quantize_row(t, "floor", "fp4")
        codes += c
        scales += s
    return codes, scales, l0s
