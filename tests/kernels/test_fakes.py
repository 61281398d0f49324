"""The semantic fakes themselves, against golden values and float64 references written here.

The vendor backends are proven by running them on these fakes, so the fakes must implement the
documented semantics (docs/kernels.md), not merely whatever the backend does.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.fake_aiter import (
    E8M0,
    FP4X2,
    FakeAiter,
    FakeAiterError,
    shuffle_scale_layout,
    unshuffle_scale_layout,
)
from tests.support.fake_torch_npu import FakeNpuError, make_fake_torch_npu
from vllm_omni_mxfp4.formats import e2m1_decode, pack_fp4


def _blocks(amaxes, dtype=torch.bfloat16):
    """One row, one 32-block per maximum: the maximum first, small values after."""
    x = torch.full((1, 32 * len(amaxes)), 0.25, dtype=torch.float32)
    for i, a in enumerate(amaxes):
        x[0, 32 * i] = a
    return x.to(dtype)


# Golden E8M0 codes (docs/kernels.md) (FLOOR, NPU UOS 7.25) for block maxima.
AMAX = [6.0, 6.5, 7.0, 7.25, 7.5, 1.75]
FLOOR_CODES = [127, 127, 127, 127, 127, 125]
UOS_CODES = [127, 127, 127, 127, 128, 125]


def test_npu_mx_quant_scale_rules_and_layout():
    npu = make_fake_torch_npu()
    x = _blocks(AMAX + [float("inf"), 0.0])  # 8 blocks
    x[0, 32 * 7 :] = 0.0  # an all-zero block
    data, scale = npu.npu_dynamic_mx_quant(x, dst_type=npu.float4_e2m1fn_x2, scale_alg=0)
    assert data.dtype == torch.uint8 and data.shape == (1, 128)
    assert scale.dtype == torch.uint8 and scale.shape == (1, 4, 2)
    assert scale.flatten().tolist() == FLOOR_CODES + [0xFF, 0]
    _, uos = npu.npu_dynamic_mx_quant(x, dst_type=npu.float4_e2m1fn_x2, scale_alg=2, dst_type_max=7.25)
    assert uos.flatten().tolist() == UOS_CODES + [0xFF, 0]
    # dst_type_max plays no part in scale_alg 0 (scenario 1): a UOS request there is silently FLOOR.
    _, ignored = npu.npu_dynamic_mx_quant(x, dst_type=npu.float4_e2m1fn_x2, scale_alg=0, dst_type_max=7.25)
    assert ignored.flatten().tolist() == FLOOR_CODES + [0xFF, 0]


def test_npu_mx_quant_pads_an_odd_block_count_and_packs_low_nibble_first():
    npu = make_fake_torch_npu()
    x = torch.zeros(2, 96, dtype=torch.bfloat16)  # 3 blocks -> 2 pairs, the last padded with 0
    x[:, 0], x[:, 1] = 1.0, -6.0  # scale 2^0 (FLOOR of 6): codes 0b0010 and 0b1111
    x[:, 64] = 4.0
    data, scale = npu.npu_dynamic_mx_quant(x, dst_type=npu.float4_e2m1fn_x2)
    assert scale.shape == (2, 2, 2) and scale[0].flatten().tolist() == [127, 0, 127, 0]
    assert data[0, 0].item() == 0b1111_0010


def test_npu_mx_quant_fp8_and_argument_rules():
    npu = make_fake_torch_npu()
    x = _blocks([448.0, 1.0])
    data, scale = npu.npu_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn, scale_alg=0)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape
    assert scale.flatten().tolist() == [127, 119]  # floor(log2 448) - 8 + 127; floor(log2 1) - 8 + 127
    with pytest.raises(TypeError):
        npu.npu_dynamic_mx_quant(x, -1)  # keyword-only after the input
    with pytest.raises(NotImplementedError, match="dst_type_max=7.25"):
        npu.npu_dynamic_mx_quant(x, dst_type=npu.float4_e2m1fn_x2, scale_alg=2)  # the bf16 mask rule (max 0)
    with pytest.raises(FakeNpuError, match="FP4 E2M1"):
        npu.npu_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn, scale_alg=0, dst_type_max=7.25)
    with pytest.raises(FakeNpuError, match="max_low_bound"):
        npu.npu_dynamic_mx_quant(x, dst_type=npu.float4_e2m1fn_x2, max_low_bound=1.0)
    with pytest.raises(FakeNpuError, match="round_mode"):
        npu.npu_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn, round_mode="round")
    with pytest.raises(FakeNpuError, match="at least 32"):
        npu.npu_dynamic_mx_quant(torch.ones(2, 16), dst_type=npu.float4_e2m1fn_x2)


def _random_mx(rows, k, seed):
    """Random E2M1 codes and E8M0 codes near 127, with their float64 values computed here."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, k), generator=g, dtype=torch.uint8)
    scales = torch.randint(122, 132, (rows, -(-k // 32)), generator=g, dtype=torch.uint8)
    values = (
        e2m1_decode(codes, torch.float64)
        * torch.pow(2.0, scales.double() - 127).repeat_interleave(32, -1)[:, :k]
    )
    pairs = torch.nn.functional.pad(scales, (0, scales.shape[1] % 2)).reshape(rows, -1, 2)
    return pack_fp4(codes), scales, pairs, values


@pytest.mark.parametrize("transposed", [True, False])
def test_npu_quant_matmul_fp4_against_float64(transposed):
    npu = make_fake_torch_npu()
    m, n, k = 5, 48, 96  # 3 blocks: an odd count
    x1, _, x1_pairs, x_vals = _random_mx(m, k, 1)
    w, _, w_pairs, w_vals = _random_mx(n, k, 2)
    bias = torch.randn(n)
    if transposed:
        x2, scale = w.transpose(0, 1), w_pairs.transpose(0, 1)
    else:  # the same operand stored (k, n/2) packed along n, scales (ceil(k/64), n, 2)
        w_kn = e2m1_decode(torch.stack((w & 0xF, w >> 4), -1).reshape(n, k)).t().contiguous()
        from vllm_omni_mxfp4.formats import e2m1_encode

        x2, scale = pack_fp4(e2m1_encode(w_kn)), w_pairs.transpose(0, 1).contiguous()
    out = npu.npu_quant_matmul(
        x1,
        x2,
        scale,
        pertoken_scale=x1_pairs,
        bias=bias,
        output_dtype=torch.float32,
        x1_dtype=npu.float4_e2m1fn_x2,
        x2_dtype=npu.float4_e2m1fn_x2,
        scale_dtype=npu.float8_e8m0fnu,
        pertoken_scale_dtype=npu.float8_e8m0fnu,
        group_sizes=[1, 1, 32],
    )
    want = x_vals @ w_vals.t() + bias.double()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


def test_npu_nz_is_an_opaque_tag():
    npu = make_fake_torch_npu()
    w = torch.randint(0, 256, (32, 64), dtype=torch.uint8)
    with pytest.raises(FakeNpuError, match="int8 view"):
        npu.npu_format_cast(w, 29, customize_dtype=torch.int8)
    with pytest.raises(FakeNpuError, match="int8 view"):
        npu.npu_format_cast(w.view(torch.int8), 29)
    nz = npu.npu_format_cast(w.view(torch.int8), 29, customize_dtype=torch.int8)
    assert npu.is_nz(nz) and not npu.is_nz(w)
    assert torch.equal(npu.npu_format_cast(nz, 2).view(torch.uint8), w)
    for view in (nz.view(torch.uint8), nz[:16], nz.reshape(64, 32), nz.transpose(0, 1)):
        assert not npu.is_nz(view)
        with pytest.raises(FakeNpuError, match="view/reshape/slice of a FRACTAL_NZ"):
            npu.npu_format_cast(view, 2)
    with pytest.raises(FakeNpuError, match="FRACTAL_NZ tensor where the op takes ND"):
        npu.npu_dynamic_mx_quant(nz, dst_type=npu.float4_e2m1fn_x2)


def test_npu_dual_level_matmul_against_float64():
    npu = make_fake_torch_npu()
    m, n, k = 3, 32, 1024
    x1, _, x1_l1, x_vals = _random_mx(m, k, 3)
    w, _, w_l1, w_vals = _random_mx(n, k, 4)
    x_l0 = torch.rand(m, 2) + 0.5
    w_l0 = torch.rand(n, 2) + 0.5
    bias = torch.randn(n)
    nz = npu.npu_format_cast(w.view(torch.int8), 29, customize_dtype=torch.int8)
    out = npu.npu_dual_level_quant_matmul(
        x1, nz, x_l0, w_l0.t().contiguous(), x1_l1, w_l1, bias=bias, output_dtype=torch.bfloat16
    )
    xs = x_vals * x_l0.double().repeat_interleave(512, -1)
    ws = w_vals * w_l0.double().repeat_interleave(512, -1)
    want = xs @ ws.t() + bias.double()
    torch.testing.assert_close(out.double(), want.to(torch.bfloat16).double(), rtol=2**-7, atol=1e-6)
    with pytest.raises(FakeNpuError, match="must be FRACTAL_NZ"):
        npu.npu_dual_level_quant_matmul(x1, w, x_l0, w_l0.t().contiguous(), x1_l1, w_l1)
    with pytest.raises(FakeNpuError, match=r"x2_level0_scale must be float32 \(2, 32\)"):
        npu.npu_dual_level_quant_matmul(x1, nz, x_l0, w_l0, x1_l1, w_l1)  # not transposed to (K/512, N)


# ---------------------------------------------------------------------------------------------- AITER


def test_aiter_weight_and_scale_shuffles_follow_aiter_layouts():
    fake = FakeAiter()
    w = torch.arange(32 * 64, dtype=torch.int32).remainder(251).to(torch.uint8).reshape(32, 64)
    s = fake.shuffle_weight(w.view(FP4X2), layout=(16, 16))
    assert s.dtype == FP4X2 and s.is_shuffled
    flat = s.view(torch.uint8).reshape(-1)
    # (16, 16) tiles: 16 bytes of row 0, then the same 16 columns of row 1, ... (n1 inside k1).
    assert torch.equal(flat[:16], w[0, :16]) and torch.equal(flat[16:32], w[1, :16])
    assert torch.equal(flat[256:272], w[0, 16:32])  # after 16 rows x 16 bytes: the next k1
    with pytest.raises(FakeAiterError, match="N % 16"):
        fake.shuffle_weight(w[:24])
    codes = torch.arange(300 * 10, dtype=torch.int32).remainder(250).to(torch.uint8).reshape(300, 10)
    sh = fake.shuffle_scale(codes.view(E8M0))
    assert sh.shape == (512, 16) and sh.dtype == E8M0
    sflat = sh.view(torch.uint8).reshape(-1)
    assert sflat[0] == codes[0, 0] and sflat[1] == codes[16, 0] and sflat[2] == codes[0, 4]
    assert torch.equal(unshuffle_scale_layout(shuffle_scale_layout(codes), 300, 10), codes)


@pytest.mark.parametrize("rule,codes", [("rceil", [125, 126, 128]), ("aiter_legacy", [126, 126, 128])])
def test_aiter_quant_rule_per_version(rule, codes):
    fake = FakeAiter(rule)
    quant = fake.get_hip_quant(fake.aiter.QuantType.per_1x32)
    data, scale = quant(_blocks([1.5, 1.75, 6.5]), shuffle=False)
    assert data.dtype == FP4X2 and data.shape == (1, 48)
    assert scale.dtype == E8M0 and scale.view(torch.uint8)[0].tolist() == codes
    _, zero = quant(torch.zeros(1, 32, dtype=torch.bfloat16))
    assert zero.view(torch.uint8).item() == (0 if rule == "rceil" else 92)  # legacy amax floor 1e-10
    with pytest.raises(FakeAiterError, match="divisible by 32"):
        quant(torch.ones(1, 48, dtype=torch.bfloat16))
    with pytest.raises(FakeAiterError, match="bf16/fp16"):
        quant(torch.ones(1, 32))


def test_aiter_gemm_against_float64():
    fake = FakeAiter()
    m, n, k = 5, 256, 128  # N: a multiple of the asm kernels' tile width
    a, a_codes, _, a_vals = _random_mx(m, k, 5)
    b, b_codes, _, b_vals = _random_mx(n, k, 6)
    bs = fake.shuffle_weight(b.view(FP4X2))
    a_s = shuffle_scale_layout(a_codes).view(E8M0)
    b_s = shuffle_scale_layout(b_codes).view(E8M0)
    out = fake.gemm_a4w4(a.view(FP4X2), bs, a_s, b_s, dtype=torch.bfloat16)  # bf16: its only output
    want = a_vals @ b_vals.t()
    assert torch.equal(out, want.float().to(torch.bfloat16))  # float32 sums, one rounding to bf16
    with pytest.raises(FakeAiterError, match="shuffle_weight"):
        fake.gemm_a4w4(a.view(FP4X2), b, a_s, b_s)
    with pytest.raises(FakeAiterError, match="padded shuffled E8M0 layout"):
        fake.gemm_a4w4(a.view(FP4X2), bs, a_codes.view(E8M0), b_s)
