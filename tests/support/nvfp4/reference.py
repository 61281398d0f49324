"""An independent, deliberately slow reference for NVFP4 dequantization and MXFP4 requantization.

Scalar Python over float64 (and numpy float32 where a single float32 rounding is the point),
written from docs/nvfp4.md. It shares no code with ``vllm_omni_mxfp4``: a bug there cannot hide
here. Used by the tests of this folder only.
"""

from __future__ import annotations

import math

import numpy as np

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_value(code: int) -> float:
    """Value of an E2M1 code 0..15 (sign in bit 3)."""
    return -E2M1[code & 7] if code & 8 else E2M1[code & 7]


def e4m3_value(byte: int) -> float:
    """Value of an FP8 E4M3 (fn) byte: 4 exponent bits (bias 7), 3 mantissa bits, 0x7F/0xFF NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 7
    if exp == 15 and man == 7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def f32(x: float) -> float:
    """``x`` rounded once to float32 (round to nearest even)."""
    return float(np.float32(x))


def nvfp4_element(code: int, scale_byte: int, g: float, order: str, divides: bool = False) -> float:
    """One NVFP4 element: ``exact`` = f32(q * s * g) rounded once (float64 holds q*s*g exactly:
    2 + 4 + 24 significant bits), ``scale_first`` = f32(q * f32(s * g))."""
    q, s = e2m1_value(code), e4m3_value(scale_byte)
    if order == "exact":
        return f32(q * s / g) if divides else f32(q * s * g)
    return f32(q * (f32(s / g) if divides else f32(s * g)))


def floor_code(amax: float) -> int:
    """OCP: floor(log2(amax)) - 2 + 127 from the float32 exponent field; 0 at or below 2^-125."""
    if amax == 0:
        return 0
    e = math.frexp(amax)[1] - 1 + 127  # biased exponent of a normal float32
    return max(e - 2, 0)


def even_code(amax: float) -> int:
    """AITER/SGLang EVEN: round amax's mantissa up at half an E2M1 ulp (1.75 -> 2), then floor."""
    if amax == 0:
        return 0
    m, e = math.frexp(amax)  # amax = m * 2^e, m in [0.5, 1)
    bumped = e + 1 if 2 * m >= 1.75 else e
    return max(bumped - 1 + 127 - 2, 0)


def rceil_code(amax: float) -> int:
    """NVIDIA RCEIL: ceil(log2(f32(amax * f32(1/6)))) + 127, for a normal product."""
    if amax == 0:
        return 0
    s = f32(amax * f32(1 / 6))
    m, e = math.frexp(s)
    return e - 1 + 127 + (0 if m == 0.5 else 1)


RULE_CODES = {"floor": floor_code, "even": even_code, "rceil": rceil_code}


def e2m1_round(y: float) -> float:
    """RNE of ``y`` onto the signed E2M1 grid, saturating at 6 (ties to the even code)."""
    a = min(abs(y), 6.0)
    best = min(range(8), key=lambda i: (abs(E2M1[i] - a), i % 2))
    return math.copysign(E2M1[best], y)


def block_sse(block: list[float], code: int) -> float:
    """Squared error (exact, :func:`math.fsum`) of a block quantized with E8M0 ``code``."""
    scale = 2.0 ** (code - 127)
    return math.fsum((e2m1_round(v / scale) * scale - v) ** 2 for v in block)


def mse_code(block: list[float]) -> int:
    """The ``mse`` rule: among floor-1, floor, floor+1 (clamped) the least squared error; ties go
    to the floor code, then to the larger one."""
    e0 = floor_code(max(abs(v) for v in block))
    cands = sorted({min(max(c, 0), 254) for c in (e0 - 1, e0, e0 + 1)})
    errors = {c: block_sse(block, c) for c in cands}
    best = min(errors.values())
    if errors[e0] == best:
        return e0
    return max(c for c in cands if errors[c] == best)


def mx_codes(block: list[float], code: int) -> list[int]:
    """E2M1 codes of a block quantized with E8M0 ``code`` (sign kept, including -0)."""
    scale = 2.0 ** (code - 127)
    out = []
    for v in block:
        r = e2m1_round(v / scale)
        out.append(E2M1.index(abs(r)) | (8 if math.copysign(1.0, r) < 0 else 0))
    return out
