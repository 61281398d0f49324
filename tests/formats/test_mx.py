"""MX quantization against golden cases (docs/kernels.md) and an independent reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_omni_mxfp4.formats import (
    dequantize_mx,
    e2m1_decode,
    e2m1_encode,
    fake_quantize_mx,
    pack_fp4,
    quantize_mx,
    unpack_fp4,
)

from . import reference as ref

DTYPES = [torch.bfloat16, torch.float16, torch.float32]

# Golden table of docs/kernels.md: block amax -> (E8M0 code, dequantized value of the max element).
GOLDEN = {
    "floor": {
        1.5: (125, 1.5),
        1.75: (125, 1.5),
        6.0: (127, 6),
        6.5: (127, 6),
        7.0: (127, 6),
        7.25: (127, 6),
        7.5: (127, 6),
    },
    "even": {
        1.5: (125, 1.5),
        1.75: (126, 2),
        6.0: (127, 6),
        6.5: (127, 6),
        7.0: (128, 8),
        7.25: (128, 8),
        7.5: (128, 8),
    },
    "rceil": {
        1.5: (125, 1.5),
        1.75: (126, 2),
        6.0: (127, 6),
        6.5: (128, 6),
        7.0: (128, 8),
        7.25: (128, 8),
        7.5: (128, 8),
    },
    "uos": {
        1.5: (125, 1.5),
        1.75: (125, 1.5),
        6.0: (127, 6),
        6.5: (127, 6),
        7.0: (127, 6),
        7.25: (127, 6),
        7.5: (128, 8),
    },
    # Older AITER HIP builds: round amax to the nearest power of two (ties up), then x 1/4.
    "aiter_legacy": {
        1.5: (126, 1.5),
        1.75: (126, 2),
        6.0: (128, 6),
        6.5: (128, 6),
        7.0: (128, 8),
        7.25: (128, 8),
        7.5: (128, 8),
    },
}
POWERS = {
    torch.bfloat16: (-60, -3, 0, 9, 60),
    torch.float16: (-8, -3, 0, 9),
    torch.float32: (-100, -3, 0, 9, 100),
}


@pytest.mark.parametrize("rule", sorted(GOLDEN))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_golden_scale_codes(rule, dtype, sign):
    for k in POWERS[dtype]:
        for amax, (code, value) in GOLDEN[rule].items():
            if rule == "aiter_legacy" and amax * 2.0**k < 1e-10:
                continue  # below AITER's 1e-10 floor (tested in test_zero_block)
            row = torch.zeros(1, 32, dtype=torch.float32)
            row[0, 5] = sign * amax * 2.0**k
            row[0, 6] = 0.5 * 2.0**k  # a smaller element that must not change the scale
            data, scale = quantize_mx(row.to(dtype), scale_rule=rule)
            assert scale.item() == code + k, (rule, dtype, amax, k)
            out = dequantize_mx(data, scale)
            assert out[0, 5].item() == sign * value * 2.0**k, (rule, dtype, amax, k)


# (scaled value, expected E2M1 code) at every rounding boundary, ties to even, saturation.
BOUNDARIES = [
    (0.0, 0),
    (0.24, 0),
    (0.25, 0),
    (0.26, 1),
    (0.5, 1),
    (0.74, 1),
    (0.75, 2),
    (0.76, 2),
    (1.0, 2),
    (1.24, 2),
    (1.25, 2),
    (1.26, 3),
    (1.5, 3),
    (1.74, 3),
    (1.75, 4),
    (2.0, 4),
    (2.49, 4),
    (2.5, 4),
    (2.51, 5),
    (3.0, 5),
    (3.49, 5),
    (3.5, 6),
    (4.0, 6),
    (4.99, 6),
    (5.0, 6),
    (5.01, 7),
    (6.0, 7),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_e2m1_rounding_boundaries(dtype):
    values = [v for v, _ in BOUNDARIES]
    for sign in (1.0, -1.0):
        row = torch.zeros(1, 64, dtype=torch.float32)
        row[0, : len(values)] = torch.tensor(values) * sign
        row[0, 63] = 6.0  # pins the scale to 2^0 under FLOOR
        x = row.to(dtype)
        data, scale = quantize_mx(x, scale_rule="floor")
        assert scale.tolist() == [[127, 127]]
        codes = unpack_fp4(data)[0, : len(values)].tolist()
        for (v, want), got, xv in zip(BOUNDARIES, codes, x[0].tolist()):
            if float(xv) != sign * v:
                continue  # not representable in this dtype; covered by the reference tests
            expect = want | (8 if sign < 0 else 0)
            assert got == expect, (dtype, sign * v, got, expect)


def test_saturation_and_signed_zero():
    x = torch.tensor([[7.5, -7.5, 6.0, -0.1, 0.1, -0.0, 0.0] + [0.0] * 25])
    data, scale = quantize_mx(x, scale_rule="floor")
    codes = unpack_fp4(data)[0, :7].tolist()
    assert scale.item() == 127
    assert codes == [7, 15, 7, 8, 0, 8, 0]


@pytest.mark.parametrize("rule", ["floor", "uos", "even", "rceil", "aiter_legacy"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_block_gets_nan_scale(rule, bad):
    x = torch.ones(2, 64)
    x[1, 40] = bad
    data, scale = quantize_mx(x.to(torch.bfloat16), scale_rule=rule)
    assert scale[1, 1].item() == 0xFF
    assert scale[1, 0].item() != 0xFF and scale[0].ne(0xFF).all()
    assert (unpack_fp4(data)[1, 32:] == 0).all()
    out = dequantize_mx(data, scale)
    assert torch.isnan(out[1, 32:]).all()
    assert torch.isfinite(out[1, :32]).all() and torch.isfinite(out[0]).all()


@pytest.mark.parametrize(
    "rule,code", [("floor", 0), ("uos", 0), ("even", 0), ("rceil", 0), ("aiter_legacy", 92)]
)
def test_zero_block(rule, code):
    x = torch.zeros(1, 32)
    x[0, 3] = -0.0
    data, scale = quantize_mx(x, scale_rule=rule)
    assert scale.item() == code
    assert unpack_fp4(data)[0].tolist() == [8 if i == 3 else 0 for i in range(32)]
    assert (dequantize_mx(data, scale) == 0).all()


def test_floor_zeroes_blocks_with_scale_code_zero():
    # amax 2^-125 has biased exponent 2 <= emax: the NPU FLOOR kernel emits code 0 and zero elements.
    x = torch.full((1, 32), 2.0**-125)
    data, scale = quantize_mx(x, scale_rule="floor")
    assert scale.item() == 0 and (unpack_fp4(data) == 0).all()
    # One exponent higher the block is representable: code 1, every element 4 * 2^-126 ... = 2^-124.
    x = torch.full((1, 32), 2.0**-124)
    data, scale = quantize_mx(x, scale_rule="floor")
    assert scale.item() == 1 and dequantize_mx(data, scale)[0, 0].item() == 2.0**-124


def test_subnormal_amax_rules():
    tiny = torch.zeros(1, 32)
    tiny[0, 0] = 2.0**-130  # a float32 subnormal
    for rule in ("floor", "uos", "even", "rceil"):
        _, scale = quantize_mx(tiny, scale_rule=rule)
        assert scale.item() == ref.scale_code(2.0**-130, rule), rule
    # RCEIL: a subnormal S = amax/6 rounds up to code 1 only when its mantissa exceeds one half.
    big_sub = torch.zeros(1, 32)
    big_sub[0, 0] = 6 * 0.75 * 2.0**-126
    _, scale = quantize_mx(big_sub, scale_rule="rceil")
    assert scale.item() == 1


@pytest.mark.parametrize("k", [2, 30, 48, 94, 130])
@pytest.mark.parametrize("rule", ["floor", "uos", "rceil"])
def test_partial_last_block_matches_zero_padding(k, rule):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(3, k, generator=g).to(torch.bfloat16)
    data, scale = quantize_mx(x, scale_rule=rule)
    groups = -(-k // 32)
    assert data.shape == (3, k // 2) and scale.shape == (3, groups)
    padded = torch.nn.functional.pad(x, (0, groups * 32 - k))
    pdata, pscale = quantize_mx(padded, scale_rule=rule)
    assert torch.equal(scale, pscale)
    assert torch.equal(data, pdata[:, : k // 2])
    assert dequantize_mx(data, scale).shape == (3, k)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="K must be even"):
        quantize_mx(torch.ones(2, 31))
    with pytest.raises(ValueError, match="scale_rule must be one of"):
        quantize_mx(torch.ones(2, 32), scale_rule="ceil")
    with pytest.raises(ValueError, match="elem='fp4' only"):
        quantize_mx(torch.ones(2, 32), elem="fp8", scale_rule="uos")
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        quantize_mx(torch.ones(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_mx(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(TypeError, match="packed uint8"):
        dequantize_mx(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))


def test_leading_dims_and_empty():
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    data, scale = quantize_mx(x)
    assert data.shape == (2, 3, 32) and scale.shape == (2, 3, 2)
    flat_d, flat_s = quantize_mx(x.reshape(6, 64))
    assert torch.equal(data.reshape(6, 32), flat_d) and torch.equal(scale.reshape(6, 2), flat_s)
    d0, s0 = quantize_mx(torch.zeros(0, 64))
    assert d0.shape == (0, 32) and s0.shape == (0, 2)


def test_chunked_path_equals_single_rows():
    # Large enough to span several CPU chunks (about 256K elements each), with a partial last block;
    # every row must equal its own quantization, quantize-dequantize and dequantization.
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(600, 1000, generator=g) * torch.exp(torch.randn(600, 1, generator=g))).to(torch.bfloat16)
    data, scale = quantize_mx(x, scale_rule="uos")
    fake = fake_quantize_mx(x, scale_rule="uos")
    values = dequantize_mx(data, scale, dtype=torch.bfloat16)
    for r in (0, 255, 256, 257, 511, 599):
        d, s = quantize_mx(x[r : r + 1], scale_rule="uos")
        assert torch.equal(d[0], data[r]) and torch.equal(s[0], scale[r])
        assert torch.equal(fake_quantize_mx(x[r : r + 1], scale_rule="uos")[0], fake[r])
        assert torch.equal(dequantize_mx(d, s, dtype=torch.bfloat16)[0], values[r])


def test_pack_unpack_and_decode_tables():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)
    packed = pack_fp4(codes)
    assert packed.tolist()[:8] == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert torch.equal(unpack_fp4(packed), codes)
    values = e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist()
    assert values[:8] == list(ref.GRID) and values[8:] == [-v for v in ref.GRID]
    assert math.copysign(1.0, values[8]) == -1.0
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 100.0, -0.3, math.nan])
    assert e2m1_encode(y).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 9, 0]


finite_floats = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32)


@st.composite
def rows(draw):
    k = draw(st.sampled_from([32, 64, 96, 40]))
    values = draw(st.lists(finite_floats, min_size=k, max_size=k))
    scale_exp = draw(st.integers(-20, 20))
    special = draw(st.sampled_from([None, "zero_block", "tiny"]))
    if special == "zero_block":
        values[:32] = [0.0] * 32
    elif special == "tiny":
        values[:32] = [v * 2.0**-120 for v in values[:32]]
    return [v * 2.0**scale_exp for v in values]


@settings(max_examples=150, deadline=None)
@given(
    values=rows(),
    rule=st.sampled_from(["floor", "uos", "even", "rceil", "aiter_legacy"]),
    dtype=st.sampled_from(DTYPES),
)
def test_fp4_matches_reference(values, rule, dtype):
    x = torch.tensor([values], dtype=torch.float32).to(dtype)
    exact = [float(v) for v in x[0].double().tolist()]
    data, scale = quantize_mx(x, scale_rule=rule)
    # The NPU UOS path takes the block maximum as a bf16 value (RINT) for fp16 inputs.
    codes, scales = ref.quantize_row(exact, rule, "fp4", amax_bf16=(rule == "uos" and dtype == torch.float16))
    assert scale[0].tolist() == scales
    assert data[0].tolist() == ref.pack_row(codes)


@settings(max_examples=60, deadline=None)
@given(values=rows(), rule=st.sampled_from(["floor", "even", "rceil"]), dtype=st.sampled_from(DTYPES))
def test_fp8_matches_reference(values, rule, dtype):
    x = torch.tensor([values], dtype=torch.float32).to(dtype)
    exact = [float(v) for v in x[0].double().tolist()]
    data, scale = quantize_mx(x, elem="fp8", scale_rule=rule)
    elems, scales = ref.quantize_row(exact, rule, "fp8")
    assert scale[0].tolist() == scales
    got = data[0].float().tolist()
    assert all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, elems))
    out = dequantize_mx(data, scale, elem="fp8").tolist()[0]
    want = [e * 2.0 ** (s - 127) for e, s in zip(elems, [c for c in scales for _ in range(32)])]
    assert all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(out, want))


@settings(max_examples=100, deadline=None)
@given(values=rows(), rule=st.sampled_from(["floor", "uos", "even", "rceil", "aiter_legacy"]))
def test_dequantize_matches_reference_and_error_bound(values, rule):
    x = torch.tensor([values], dtype=torch.float32)
    data, scale = quantize_mx(x, scale_rule=rule)
    out = dequantize_mx(data, scale, dtype=torch.float64)[0].tolist()
    codes = unpack_fp4(data)[0].tolist()
    scales = scale[0].tolist()
    for i, (o, c) in enumerate(zip(out, codes)):
        s = scales[i // 32]
        assert o == ref.dequant_value(c, s)
        if rule == "floor" and s == 0:
            continue
        step = 2.0 ** (s - 127)
        y = abs(float(x[0, i])) / step
        bound = 0.25 if y <= 2 else 0.5 if y <= 4 else 1.0 if y <= 6 else y - 6
        assert abs(o - float(x[0, i])) <= bound * step * (1 + 1e-12)


@settings(max_examples=100, deadline=None)
@given(
    values=rows(),
    rule=st.sampled_from(["floor", "uos", "even", "rceil", "aiter_legacy"]),
    dtype=st.sampled_from(DTYPES),
)
def test_requantizing_dequantized_values(values, rule, dtype):
    x = torch.tensor([values], dtype=torch.float32).to(dtype)
    data, scale = quantize_mx(x, scale_rule=rule)
    dq = dequantize_mx(data, scale, dtype=torch.float32)
    if dtype != torch.float32 and not torch.equal(dq.to(dtype).float(), dq):
        return  # the dequantized values are not all representable in this dtype
    data2, scale2 = quantize_mx(dq.to(dtype), scale_rule=rule)
    dq2 = dequantize_mx(data2, scale2)
    if rule in ("floor", "uos", "even"):
        # These rules map a quantized block's maximum (4 or 6 times the scale) back to the same scale.
        assert torch.equal(data2, data) and torch.equal(scale2, scale)
    elif rule == "rceil":
        # RCEIL may choose a smaller scale for a block whose maximum became 3 x scale; the values
        # are unchanged.
        assert torch.equal(dq2, dq)
    else:
        # AITER legacy rounds the block maximum to the nearest power of two, so a maximum of 6 x scale
        # (1.5 x 2^2 x scale) gets twice the scale and small elements can round away. The block
        # maxima survive, and a second round changes nothing.
        blocks = -(-dq.shape[-1] // 32)
        pad = blocks * 32 - dq.shape[-1]
        amax = torch.nn.functional.pad(dq.abs(), (0, pad)).reshape(-1, blocks, 32).amax(-1)
        amax2 = torch.nn.functional.pad(dq2.abs(), (0, pad)).reshape(-1, blocks, 32).amax(-1)
        assert torch.equal(amax2, amax)
        data3, scale3 = quantize_mx(dq2.to(dtype), scale_rule=rule)
        assert torch.equal(data3, data2) and torch.equal(scale3, scale2)


def test_float64_reference_on_a_large_random_tensor():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(8, 512, generator=g) * torch.exp(2 * torch.randn(8, 512, generator=g))).to(
        torch.bfloat16
    )
    for rule in ("floor", "uos"):
        data, scale = quantize_mx(x, scale_rule=rule)
        for r in range(8):
            codes, scales = ref.quantize_row([float(v) for v in x[r].double().tolist()], rule)
            assert scale[r].tolist() == scales
            assert data[r].tolist() == ref.pack_row(codes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(257, 1000, generator=g).to(torch.bfloat16)
    for rule in ("floor", "uos", "even", "rceil", "aiter_legacy"):
        for elem in ("fp4", "fp8"):
            if elem == "fp8" and rule in ("uos", "aiter_legacy"):
                continue
            d_cpu, s_cpu = quantize_mx(x, elem=elem, scale_rule=rule)
            d_gpu, s_gpu = quantize_mx(x.cuda(), elem=elem, scale_rule=rule)
            assert torch.equal(s_gpu.cpu(), s_cpu)
            assert torch.equal(d_gpu.cpu().view(torch.uint8), d_cpu.view(torch.uint8))
            assert torch.equal(
                dequantize_mx(d_gpu, s_gpu, elem=elem).cpu().nan_to_num(),
                dequantize_mx(d_cpu, s_cpu, elem=elem).nan_to_num(),
            )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule,elem", [("floor", "fp4"), ("uos", "fp4"), ("rceil", "fp4"), ("floor", "fp8")])
def test_fake_quantize_equals_dequantize_of_quantize(dtype, rule, elem):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(70, 1000, generator=g) * torch.exp(2 * torch.randn(70, 1000, generator=g))
    x[3, 5] = math.nan
    x[4, 100] = math.inf
    x[5, :32] = 0.0
    x = x.to(dtype)
    qdq = fake_quantize_mx(x, elem=elem, scale_rule=rule)
    want = dequantize_mx(*quantize_mx(x, elem=elem, scale_rule=rule), elem=elem, dtype=dtype)
    assert qdq.dtype == dtype and qdq.shape == x.shape
    assert torch.equal(qdq.isnan(), want.isnan())
    assert torch.equal(qdq.nan_to_num(0.0), want.nan_to_num(0.0))


def test_dequantize_into_a_given_output():
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    data, scale = quantize_mx(x)
    out = torch.full((3, 5, 64), 7.0, dtype=torch.bfloat16)
    got = dequantize_mx(data, scale, dtype=torch.bfloat16, out=out)
    assert got is out
    assert torch.equal(out, dequantize_mx(data, scale, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        dequantize_mx(data, scale, dtype=torch.float32, out=out)
    with pytest.raises(ValueError, match="contiguous"):
        dequantize_mx(
            data,
            scale,
            dtype=torch.bfloat16,
            out=torch.empty(64, 5, 3, dtype=torch.bfloat16).permute(2, 1, 0),
        )
