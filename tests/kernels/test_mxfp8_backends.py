"""MXFP8 W8A8 layers on the vendor backends: the NPU kernel on the semantic torch_npu fake (its MX
FP8 mode), equal to the emulated kernel layer by layer and on vLLM-Omni's Wan2.2 model; ROCm refuses
them naming the alternatives."""

from __future__ import annotations

import pytest
import torch

from tests.support.compare import assert_within_rounding, both
from tests.support.fake_torch_npu import FakeNpuError
from tests.support.layers import (
    K,
    N,
    build,
    build_expert,
    exact,
    forward,
    mxfp8_dir,
    run,
    set_kernels,
    weights,
)
from vllm_omni_mxfp4.formats import e4m3_decode, quantize_mxfp8
from vllm_omni_mxfp4.kernels import (
    AiterSingle,
    EmulatedAiterSingle,
    KernelSelector,
    MxLayerSpec,
    NpuMxfp8,
    NpuSingle,
)

from .conftest import install_aiter

pytestmark = pytest.mark.omni

__all__ = ["mxfp8_dir"]  # module fixtures

PREFIX = "blocks.1.attn2.to_q"
SPEC = {"method": "mxfp4", "is_checkpoint_mxfp4_serialized": True, "mxfp8_layers": [PREFIX]}


def _ckpt(seed):
    w, b, x = weights(seed)
    data, scale = quantize_mxfp8(w)
    return {"weight": data, "weight_scale": scale}, b, x


def test_fake_mx_fp8_mode_computes_the_float64_product_and_refuses_other_modes(fake_npu):
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(4, 96, generator=g), torch.randn(8, 96, generator=g)
    x_q, x_s = fake_npu.npu_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn, scale_alg=0)
    w_q, w_s = quantize_mxfp8(w)
    w_pairs = fake_npu.npu_dynamic_mx_quant(w, dst_type=torch.float8_e4m3fn, scale_alg=0)[1]
    bias = torch.randn(8, generator=g)
    kw = dict(
        scale_dtype=fake_npu.float8_e8m0fnu, pertoken_scale=x_s, pertoken_scale_dtype=fake_npu.float8_e8m0fnu
    )
    out = fake_npu.npu_quant_matmul(
        x_q,
        w_q.transpose(0, 1),
        w_pairs.transpose(0, 1),
        bias=bias,
        output_dtype=torch.float32,
        group_sizes=[1, 1, 32],
        **kw,
    )
    xs = x_s.reshape(4, -1)[:, :3].double()
    xv = e4m3_decode(x_q).double() * torch.pow(2.0, xs - 127).repeat_interleave(32, dim=1)
    wv = e4m3_decode(w_q).double() * torch.pow(2.0, w_s.double() - 127).repeat_interleave(32, dim=1)
    want = xv @ wv.T + bias.double()
    assert torch.allclose(out.double(), want, rtol=1e-6, atol=1e-6)
    call = dict(bias=bias, output_dtype=torch.float32, **kw)
    with pytest.raises(FakeNpuError, match=r"MX FP8 x FP8 needs group_sizes \[1, 1, 32\]"):
        fake_npu.npu_quant_matmul(
            x_q, w_q.transpose(0, 1), w_pairs.transpose(0, 1), group_sizes=[0, 0, 32], **call
        )
    with pytest.raises(FakeNpuError, match="MX bias must be float32"):
        fake_npu.npu_quant_matmul(
            x_q,
            w_q.transpose(0, 1),
            w_pairs.transpose(0, 1),
            group_sizes=[1, 1, 32],
            **{**call, "bias": bias.bfloat16()},
        )


def test_npu_call_arguments(vllm_env, fake_npu):
    ckpt, b, x = _ckpt(61)
    layer = build(vllm_env, {**SPEC, "backend": "npu"}, ckpt, bias=b)
    run(vllm_env, layer, x)
    quant = [kw for op, _, kw in fake_npu.calls if op == "npu_dynamic_mx_quant"][-1]
    assert (quant["dst_type"], quant["scale_alg"], quant["round_mode"]) == (torch.float8_e4m3fn, 0, "rint")
    _, (x_q, w, scale), kw = [c for c in fake_npu.calls if c[0] == "npu_quant_matmul"][-1]
    assert x_q.dtype == w.dtype == torch.float8_e4m3fn
    assert w.data_ptr() == layer.weight.data_ptr() and w.stride() == (1, K)  # the parameter, transposed
    assert tuple(scale.shape) == (K // 64, N, 2)
    assert kw["group_sizes"] == [1, 1, 32] and kw["x1_dtype"] is None and kw["x2_dtype"] is None
    assert kw["bias"].dtype == torch.float32 and kw["output_dtype"] == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_npu_layer_equals_emulated(vllm_env, fake_npu, dtype):
    ckpt, b, x = _ckpt(62)
    vendor, emulated = both(vllm_env, SPEC, ckpt, "npu", bias=b, dtype=dtype)
    assert type(vendor._mx.kernel) is NpuMxfp8
    assert_within_rounding(run(vllm_env, vendor, x.to(dtype)), run(vllm_env, emulated, x.to(dtype)))


def test_wan_expert_with_mxfp8_block_on_npu_kernels(vllm_env, mxfp8_dir, fake_npu):
    model = build_expert(vllm_env, mxfp8_dir, None)
    set_kernels(model, lambda fmt: NpuMxfp8() if fmt == "mxfp8" else NpuSingle())
    out = forward(vllm_env, model)
    fp8_calls = [
        c for c in fake_npu.calls if c[0] == "npu_quant_matmul" and c[1][1].dtype == torch.float8_e4m3fn
    ]
    assert len(fp8_calls) == 8  # block 0's Linears
    set_kernels(model, exact)
    assert torch.equal(out, forward(vllm_env, model))


def test_rocm_refuses_mxfp8_naming_the_alternatives(vllm_env, monkeypatch):
    install_aiter(monkeypatch, "rceil")
    spec = MxLayerSpec(PREFIX, "mxfp8", "floor", K, N)
    for kernel in (AiterSingle(), EmulatedAiterSingle(rule="rceil")):
        ok, why = kernel.can_implement(spec)
        assert not ok
        assert why.startswith(
            f"{PREFIX}: MXFP8 W8A8 (a layer the checkpoint stores as MXFP8, listed in mxfp8_layers)"
        )
        assert "--mxfp8-layers bf16" in why and "'emulated'" in why and "'npu'" in why
    with pytest.raises(NotImplementedError, match="MXFP8 W8A8 .* is not supported by the ROCm backend"):
        build(vllm_env, {**SPEC, "backend": "rocm"}, {})
    assert type(KernelSelector("emulated").kernel_for(spec)).__name__ == "EmulatedMxfp8"


def test_npu_row_shard_with_k_padding_equals_emulated(fake_npu, plain_layer):
    """A row-parallel shard whose K range starts inside a block: rank 1 of K=192 over TP=4 holds
    inputs [48, 96), pads 16 zero inputs in front to line up with the scales of blocks 1-2."""
    from vllm_omni_mxfp4.config import Precision
    from vllm_omni_mxfp4.kernels import EmulatedMxfp8

    w, _, x = weights(64, k=192)
    data, scale = quantize_mxfp8(w)
    layer = plain_layer({"weight": data[:, 48:96].contiguous(), "weight_scale": scale[:, 1:3].contiguous()})
    spec = MxLayerSpec("blocks.0.ffn.net_2", "mxfp8", "floor", 48, N, k_pad_front=16)
    xs = x.reshape(-1, 192)[:, 48:96]
    outs = []
    for kernel in (NpuMxfp8(), EmulatedMxfp8(compute_dtype="float32")):
        outs.append(kernel.apply(layer, kernel.prepare(layer, spec, None), xs, None, Precision.W8A8))
    assert_within_rounding(*outs)
    padded = [c[1][1] for c in fake_npu.calls if c[0] == "npu_quant_matmul"][-1]
    assert tuple(padded.shape) == (64, N)  # the weight's K padded to whole blocks, transposed
