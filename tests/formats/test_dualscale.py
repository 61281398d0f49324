"""Dual-level MXFP4 against a float64/float32 reference of the NPU kernel (docs/kernels.md)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_omni_mxfp4.formats import (
    dequantize_dualscale,
    from_npu_scale_layout,
    quantize_dualscale,
    quantize_mx,
    to_npu_scale_layout,
    unpack_fp4,
)

from . import reference as ref


def _check_row(x_row: torch.Tensor, smooth: torch.Tensor | None, data, scale, dual):
    values = [float(v) for v in x_row.double().tolist()]
    sm = [float(v) for v in smooth.to(torch.bfloat16).double().tolist()] if smooth is not None else None
    codes, scales, l0s = ref.dualscale_row(values, sm)
    assert dual.tolist() == l0s
    assert scale.tolist() == scales
    assert data.tolist() == ref.pack_row(codes)


@pytest.mark.parametrize("k", [512, 1024, 1536, 640])
def test_dualscale_bytes_match_reference(k):
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(4, k, generator=g) * torch.exp(torch.randn(4, k, generator=g))).to(torch.bfloat16)
    data, scale, dual = quantize_dualscale(x)
    chunks = -(-k // 512)
    assert data.shape == (4, k // 2) and scale.shape == (4, k // 32) and dual.shape == (4, chunks)
    assert dual.dtype == torch.float32
    for r in range(4):
        _check_row(x[r], None, data[r], scale[r], dual[r])


def test_smooth_is_applied_before_quantization():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 1024, generator=g).to(torch.bfloat16)
    smooth = torch.exp(torch.randn(1024, generator=g))  # float32, as checkpoints store it
    data, scale, dual = quantize_dualscale(x, smooth=smooth)
    for r in range(3):
        _check_row(x[r], smooth, data[r], scale[r], dual[r])
    # Smooth changes the bytes, and equals quantizing the pre-multiplied (bf16-rounded) input.
    plain = quantize_dualscale(x)
    assert not torch.equal(plain[0], data)
    pre = quantize_dualscale(x * smooth.to(torch.bfloat16))
    assert all(torch.equal(a, b) for a, b in zip(pre, (data, scale, dual)))
    # Dequantizing with the same smooth divides it out again.
    back = dequantize_dualscale(data, scale, dual, smooth=smooth)
    xs = (x * smooth.to(torch.bfloat16)).float()
    assert ((back * smooth - xs).norm() / xs.norm()) < 0.15
    assert torch.allclose(back * smooth, dequantize_dualscale(data, scale, dual), rtol=1e-6, atol=0)


def test_dualscale_max_block_has_unit_fine_scale_and_values_dequantize():
    x = torch.zeros(1, 512)
    x[0, 100] = 3.0
    x[0, 300] = -0.75
    data, scale, dual = quantize_dualscale(x.to(torch.bfloat16))
    assert dual.item() == ref.f32_mul(3.0, float(1 / 6.0).__class__(ref.np.float32(1 / 6)))
    assert scale[0, 100 // 32].item() == 127  # the 32-block with the chunk maximum: t = 6 -> 2^0
    out = dequantize_dualscale(data, scale, dual)
    assert out[0, 100].item() == pytest.approx(3.0, rel=1e-6)
    assert out[0, 300].item() == pytest.approx(-0.75, rel=0.2)


def test_dequantize_dualscale_formula_and_checkpoint_shape():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 1024, generator=g).to(torch.bfloat16)
    data, scale, dual = quantize_dualscale(x)
    out = dequantize_dualscale(data, scale, dual.unsqueeze(-1), dtype=torch.float64)
    codes = unpack_fp4(data)
    for r in range(2):
        for i in (0, 31, 32, 511, 512, 1023):
            want = ref.dequant_value(int(codes[r, i]), int(scale[r, i // 32])) * float(dual[r, i // 512])
            assert out[r, i].item() == float(ref.np.float32(want))
    with pytest.raises(ValueError, match="dual_scale shape"):
        dequantize_dualscale(data, scale, dual[:, :1])


def test_non_finite_inputs_and_zero_chunks():
    x = torch.zeros(2, 512)
    x[0, 0] = math.inf
    x[0, 40] = 2.0
    data, scale, dual = quantize_dualscale(x.to(torch.bfloat16))
    # Inf is ignored by the coarse amax, then becomes Inf / L0 -> its 32-block gets the NaN scale.
    assert dual[0, 0].item() == ref.f32_mul(2.0, float(ref.np.float32(1 / 6)))
    assert scale[0, 0].item() == 0xFF and scale[0, 1].item() == 127
    assert dual[1, 0].item() == 0.0 and (scale[1] == 0).all() and (data[1] == 0).all()


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    k=st.sampled_from([512, 1024, 576]),
    exp=st.integers(-30, 30),
    tail=st.floats(0.0, 3.0),
    zeros=st.integers(0, 600),
    use_smooth=st.booleans(),
)
def test_dualscale_property_matches_reference(seed, k, exp, tail, zeros, use_smooth):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g) * torch.exp(tail * torch.randn(1, k, generator=g)) * 2.0**exp
    x[0, :zeros] = 0.0
    x = x.to(torch.bfloat16)
    smooth = torch.linspace(0.25, 4.0, k) if use_smooth else None
    data, scale, dual = quantize_dualscale(x, smooth=smooth)
    _check_row(x[0], smooth, data[0], scale[0], dual[0])


def test_npu_scale_layout_pads_odd_group_counts():
    s = torch.arange(1, 16, dtype=torch.uint8).reshape(3, 5)
    npu = to_npu_scale_layout(s)
    assert npu.shape == (3, 3, 2)
    assert npu[:, -1, -1].tolist() == [0, 0, 0]
    assert torch.equal(from_npu_scale_layout(npu, 5), s)
    even = to_npu_scale_layout(s[:, :4])
    assert even.shape == (3, 2, 2) and torch.equal(even.reshape(3, 4), s[:, :4])
    with pytest.raises(ValueError, match="expected"):
        from_npu_scale_layout(npu, 7)


def test_dualscale_rejects_bad_smooth():
    with pytest.raises(ValueError, match="smooth must be 1-D of length K=512"):
        quantize_dualscale(torch.ones(2, 512), smooth=torch.ones(256))


def test_floor_mx_of_normalised_values_is_the_fine_level():
    # Level 1 is plain FLOOR MXFP4 of t = bf16(x / L0): check against quantize_mx directly.
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 512, generator=g).to(torch.bfloat16)
    data, scale, dual = quantize_dualscale(x)
    t = (x.float() / dual).to(torch.bfloat16)
    d2, s2 = quantize_mx(t, scale_rule="floor")
    assert torch.equal(d2, data) and torch.equal(s2, scale)


def test_dualscale_does_not_depend_on_how_rows_are_chunked():
    """A tensor larger than one CPU chunk equals its rows quantized one by one."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(600, 1024, generator=g).to(torch.bfloat16)
    smooth = torch.rand(1024, generator=g) + 0.5
    data, scale, dual = quantize_dualscale(x, smooth=smooth)
    for i in (0, 255, 256, 599):
        d, s, l0 = quantize_dualscale(x[i : i + 1], smooth=smooth)
        assert torch.equal(data[i : i + 1], d) and torch.equal(scale[i : i + 1], s)
        assert torch.equal(dual[i : i + 1], l0)
