"""The NPU kernels on the semantic torch_npu fake, against the emulated kernels (NPU numerics).

The fake's GEMMs dequantize their operands and multiply in float32, as the emulated kernels with
``compute_dtype="float32"`` do, so outputs must be bit-identical wherever both multiply the same
(M, K) x (K, N) problem; with K padding (tensor-parallel shards, whole 512-chunks) they agree up
to float32 summation order. How the kernels call torch_npu is checked in ``test_npu_binding.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.compare import assert_within_rounding, both, reference
from tests.support.layers import K, N, run, smooth_vector, weights
from vllm_omni_mxfp4.config import Precision
from vllm_omni_mxfp4.formats import dequantize_dualscale, quantize_dualscale, quantize_mx
from vllm_omni_mxfp4.kernels import (
    EmulatedDual,
    EmulatedSingle,
    MxLayerSpec,
    NpuDual,
    NpuSingle,
    SharedBlocks,
)

pytestmark = pytest.mark.omni


# ------------------------------------------------------------------------------------- single scale


@pytest.mark.parametrize("alg", [0, 2])
@pytest.mark.parametrize("kind", ["column", "row", "replicated"])
def test_online_mxfp4_equals_emulated(vllm_env, fake_npu, alg, kind):
    w, b, x = weights(alg + 20)
    spec = {"method": "mxfp4", "mxfp4_scale_alg": alg}
    npu, emu = both(vllm_env, spec, {"weight": w}, "npu", kind=kind, bias=b)
    assert torch.equal(npu.weight, emu.weight) and torch.equal(npu.weight_scale, emu.weight_scale)
    assert set(npu.state_dict()) == {"weight", "weight_scale", "bias"}
    assert torch.equal(run(vllm_env, npu, x), run(vllm_env, emu, x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("smooth", [False, True])
def test_offline_mxfp4_with_smooth_equals_emulated(vllm_env, fake_npu, dtype, smooth):
    w, b, x = weights(21, dtype=dtype)
    data, scale = quantize_mx(w)
    ckpt = {"weight": data, "weight_scale": scale}
    if smooth:
        ckpt["mul_scale"] = smooth_vector(K)
    spec = {"method": "mxfp4", "is_checkpoint_mxfp4_serialized": True}
    npu, emu = both(vllm_env, spec, ckpt, "npu", dtype=dtype, bias=b)
    out = run(vllm_env, npu, x)
    assert out.dtype == dtype and torch.equal(out, run(vllm_env, emu, x))
    assert torch.equal(npu.weight, data)  # the packed checkpoint weight is used in place


def test_odd_scale_group_count(vllm_env, fake_npu):
    k = 224  # 7 groups of 32: the NPU scale layout pads them to pairs
    w, b, x = weights(22, k=k)
    npu, emu = both(vllm_env, {"method": "mxfp4"}, {"weight": w}, "npu", k=k, bias=b)
    assert torch.equal(run(vllm_env, npu, x), run(vllm_env, emu, x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_w4a8_layer_equals_emulated(vllm_env, fake_npu, dtype):
    w, b, x = weights(23, dtype=dtype)
    spec = {"method": "mxfp4", "w4a8_fallback_layers": ["blocks.1.attn2.to_q"]}
    npu, emu = both(vllm_env, spec, {"weight": w}, "npu", dtype=dtype, bias=b)
    out = run(vllm_env, npu, x)
    assert out.dtype == dtype and torch.equal(out, run(vllm_env, emu, x))


def test_w4a8_steps_switch_per_call(vllm_env, fake_npu):
    from vllm_omni_mxfp4.steps import denoise_step

    w, b, x = weights(24)
    spec = {"method": "mxfp4", "w4a8_fallback_steps": [1]}
    npu, emu = both(vllm_env, spec, {"weight": w}, "npu", bias=b)
    outs = []
    for step in range(3):
        with denoise_step(step):
            out = run(vllm_env, npu, x)
            assert torch.equal(out, run(vllm_env, emu, x)), step
            outs.append(out)
    assert not torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


# --------------------------------------------------------------------------------------- dual scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_online_dualscale_equals_emulated(vllm_env, fake_npu, dtype):
    k = 1024
    w, b, x = weights(25, k=k, dtype=dtype)
    spec = {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0}
    npu, emu = both(vllm_env, spec, {"weight": w}, "npu", k=k, dtype=dtype, bias=b)
    for name in ("weight_scale", "weight_dual_scale"):
        assert torch.equal(getattr(npu, name), getattr(emu, name)), name
    state = npu.state_dict()  # the weight's storage holds the NZ layout; the state dict the checkpoint
    assert set(state) == {"weight", "weight_scale", "weight_dual_scale", "bias"}
    assert state["weight"].dtype == torch.uint8 and torch.equal(state["weight"], emu.weight)
    out = run(vllm_env, npu, x)
    assert out.dtype == dtype and torch.equal(out, run(vllm_env, emu, x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [1024, 768])
def test_offline_dualscale_with_smooth_equals_emulated(vllm_env, fake_npu, k, dtype):
    """float32 callers: both round the activations to bf16 BEFORE Smooth (the dual-level quantizer
    takes bf16 and applies Smooth itself), and the output is bf16-rounded."""
    w, b, x = weights(26, k=k, dtype=dtype)
    smooth = smooth_vector(k)
    data, scale, dual = quantize_dualscale((w.float() / smooth).to(torch.bfloat16))
    ckpt = {
        "weight": data,
        "weight_scale": scale,
        "weight_dual_scale": dual.unsqueeze(-1),
        "mul_scale": smooth,
    }
    spec = {"method": "mxfp4_dualscale", "is_checkpoint_serialized": True}
    npu, emu = both(vllm_env, spec, ckpt, "npu", k=k, bias=b, dtype=dtype)
    out, want = run(vllm_env, npu, x), run(vllm_env, emu, x)
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(out, out.to(torch.bfloat16).float())  # the kernel's bf16 output
        x2 = x.reshape(-1, k).to(torch.bfloat16)  # rounded first, then Smooth in bf16
        ref = reference(x2, dequantize_dualscale(data, scale, dual), b, smooth=smooth, dual=True)
        assert torch.equal(want.reshape(-1, N), ref.float())
    if k == 1024:
        assert torch.equal(out, want)
    else:  # padded to 1024 for the kernel: the same products, summed in another order
        assert_within_rounding(out, want)
    assert torch.equal(npu.state_dict()["weight"], data)


def _shard(dual, k0, k, seed=27):
    """A row-parallel shard [k0, k0 + k) of a 3-block layer: its checkpoint slices, x, Smooth, pads."""
    block = 512 if dual else 32
    k_full = 3 * block
    front, back = k0 % block, -(k0 + k) % block
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, k_full, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(6, k, generator=g).to(torch.bfloat16)
    smooth = smooth_vector(k).to(torch.bfloat16)
    lo, hi = k0 - front, k0 + k + back
    if dual:
        data, scale, dual_scale = quantize_dualscale(w)
        ckpt = {"weight_dual_scale": dual_scale[:, lo // 512 : hi // 512].unsqueeze(-1)}
    else:
        data, scale = quantize_mx(w)
        ckpt = {}
    ckpt |= {"weight": data[:, k0 // 2 : (k0 + k) // 2], "weight_scale": scale[:, lo // 32 : hi // 32]}
    return ckpt, x, smooth, front, back


@pytest.mark.parametrize(
    "dual,k0,k",
    [(True, 256, 512), (True, 384, 384), (False, 16, 32), (False, 24, 32)],
    ids=["dual-equal-pads", "dual-384+256", "single-equal-pads", "single-24+8"],
)
@pytest.mark.parametrize("shared", [False, True])
def test_row_parallel_shard_with_k_padding(fake_npu, plain_layer, dual, k0, k, shared):
    """A shard whose K range straddles scale blocks (Wan ffn.net_2 at TP=2), with equal or unequal
    front/back padding, alone or sharing its edge blocks' maxima with a neighbour rank (here one
    whose part of each shared block peaks at 40.0): the NPU kernel computes what the emulated one does."""
    ckpt, x, smooth, front, back = _shard(dual, k0, k)
    fmt = "mxfp4_dualscale" if dual else "mxfp4"
    neighbour = SharedBlocks(
        512 if dual else 32, (0, 1), 0, 1, lambda t: torch.maximum(t, torch.full_like(t, 40.0))
    )
    pads = {"k_pad_front": front, "k_pad_back": back}
    spec = MxLayerSpec("blocks.0.ffn.net_2", fmt, "floor", k, N, **pads, shared=neighbour if shared else None)
    kernels = (
        (NpuDual(), EmulatedDual(compute_dtype="float32"))
        if dual
        else (NpuSingle(), EmulatedSingle(compute_dtype="float32"))
    )
    outs = []
    for kernel in kernels:
        layer = plain_layer(ckpt)
        outs.append(kernel.apply(layer, kernel.prepare(layer, spec, smooth), x, None, Precision.W4A4))
    assert_within_rounding(*outs)
    if shared:  # the neighbour's maximum changed the quantization of this rank's edge blocks
        alone = MxLayerSpec("blocks.0.ffn.net_2", fmt, "floor", k, N, **pads)
        layer = plain_layer(ckpt)
        kernel = kernels[0]
        assert not torch.equal(
            kernel.apply(layer, kernel.prepare(layer, alone, smooth), x, None, Precision.W4A4), outs[0]
        )


def test_npu_dual_refuses_w4a8_before_allocation(vllm_env, fake_npu):
    ok, why = NpuDual().can_implement(MxLayerSpec("blocks.0.x", "mxfp4_dualscale", "floor", K, N, w4a8=True))
    assert not ok and "blocks.0.x: w4a8 is not supported by the npu backend" in why
