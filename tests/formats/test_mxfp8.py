"""MXFP8 (E4M3 elements, E8M0 per 32, OCP rule): golden values from the OCP MX v1.0 spec and the
independent float64 reference of ``tests/formats/reference.py``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.formats import reference as ref
from vllm_omni_mxfp4 import spec
from vllm_omni_mxfp4.formats import (
    dequantize_mxfp8,
    e4m3_decode,
    e4m3_encode,
    fake_quantize_mxfp8,
    quantize_mxfp8,
)

# OCP MX v1.0 table 2 (FP8 E4M3): code -> value.
E4M3_GOLDEN = {
    0x00: 0.0,
    0x01: 2.0**-9,  # smallest subnormal
    0x07: 7 * 2.0**-9,  # largest subnormal
    0x08: 2.0**-6,  # smallest normal
    0x38: 1.0,
    0x3F: 1.875,
    0x40: 2.0,
    0x7E: 448.0,  # largest normal
    0x80: -0.0,
    0xB8: -1.0,
    0xFE: -448.0,
}


def test_e4m3_decode_golden_values():
    codes = torch.tensor(list(E4M3_GOLDEN), dtype=torch.uint8)
    values = e4m3_decode(codes).tolist()
    assert values == list(E4M3_GOLDEN.values())
    assert math.copysign(1.0, values[list(E4M3_GOLDEN).index(0x80)]) == -1.0
    nan = e4m3_decode(torch.tensor([0x7F, 0xFF], dtype=torch.uint8))
    assert torch.isnan(nan).all()


def test_e4m3_decode_covers_every_code_as_the_reference_grid():
    grid = ref.e4m3_grid()  # magnitudes of codes 0x00..0x7E from the bit fields, written independently
    decoded = e4m3_decode(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn))
    assert decoded[:0x7F].tolist() == grid
    assert decoded[0x80:0xFF].tolist() == [-v for v in grid]


@pytest.mark.parametrize(
    "x,code",
    [
        (1.0625, 0x38),  # tie between 1.0 and 1.125: even mantissa (1.0)
        (1.1875, 0x3A),  # tie between 1.125 and 1.25: even mantissa (1.25)
        (1.0624, 0x38),
        (1.0626, 0x39),
        (464.0, 0x7E),  # beyond 448 saturates (E4M3 fn has no Inf)
        (1e6, 0x7E),
        (-1e6, 0xFE),
        (2.0**-10, 0x00),  # half the smallest subnormal: tie to even (zero)
        (3 * 2.0**-10, 0x02),  # tie between 2^-9 and 2^-8: even mantissa
        (-0.0, 0x80),
        (float("nan"), 0x7F),
    ],
)
def test_e4m3_encode_rounds_to_nearest_even_and_saturates(x, code):
    assert int(e4m3_encode(torch.tensor([x], dtype=torch.float64))[0]) == code


def test_e4m3_encode_matches_the_reference_rounding():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, generator=g, dtype=torch.float64) * torch.exp(3 * torch.randn(4096, generator=g))
    x = x.float()
    got = e4m3_decode(e4m3_encode(x)).tolist()
    assert got == [ref.e4m3_value(v) for v in x.tolist()]


@pytest.mark.parametrize(
    "amax,code",
    [
        (448.0, 127),  # floor(log2 448) = 8: 2^(8 - 8)
        (1.0, 119),  # 2^-8
        (1.99, 119),
        (2.0, 120),
        (2.0**-118, 1),  # biased exponent 9: the smallest non-zero code
        (2.0**-119, 0),  # biased exponent 8: code 0, and the block is zeroed (NPU FLOOR)
        (0.0, 0),
        (float("inf"), 255),
    ],
)
def test_block_scale_is_the_ocp_floor_rule(amax, code):
    x = torch.zeros(1, 64)
    x[0, 5] = amax
    x[0, 40] = 1.0  # a second block with its own scale
    data, scale = quantize_mxfp8(x)
    assert data.dtype == torch.float8_e4m3fn and tuple(data.shape) == (1, 64)
    assert scale.dtype == torch.uint8 and scale.tolist() == [[code, 119]]
    if code == 0:
        assert data[0, :32].float().eq(0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [32, 96, 100])
def test_quantize_and_dequantize_match_the_float64_reference(dtype, k):
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(6, k, generator=g) * torch.exp(2 * torch.randn(6, k, generator=g))).to(dtype)
    data, scale = quantize_mxfp8(x)
    deq = dequantize_mxfp8(data, scale)
    for row in range(x.shape[0]):
        values = x[row].double().tolist()
        elems, scales = ref.quantize_row(values, "floor", "fp8")
        assert scale[row].tolist() == scales
        assert data[row].float().tolist() == elems
        want = [e * 2.0 ** (scales[i // 32] - 127) for i, e in enumerate(elems)]
        assert deq[row].double().tolist() == want
    assert torch.equal(fake_quantize_mxfp8(x), deq.to(dtype))


def test_dequantize_nan_scale_and_bf16_output_are_exact():
    data, scale = quantize_mxfp8(torch.tensor([[3.0] * 31 + [float("nan")] + [0.5] * 32]))
    assert scale.tolist() == [[255, 118]]
    out = dequantize_mxfp8(data, scale, dtype=torch.bfloat16)
    assert torch.isnan(out[0, :32]).all()
    assert out[0, 32:].float().eq(0.5).all()


def test_the_e4m3_value_rule_flags_exactly_the_nan_codes():
    rule = spec.VALUE_RULES["e4m3"]
    codes = np.arange(256, dtype=np.uint8)
    assert np.flatnonzero(rule.bad(codes, np)).tolist() == [0x7F, 0xFF]
    flagged = rule.bad(torch.arange(256, dtype=torch.uint8), torch)
    assert flagged.nonzero().flatten().tolist() == [0x7F, 0xFF]
    assert spec.checkpoint_tensor("mxfp8", "weight").describe() == "weight: F8_E4M3 (N, K)"
    assert spec.checkpoint_tensor("mxfp8", "weight_scale").shape(4, 96) == (4, 3)
