"""Tensor-parallel sharding of MXFP4 checkpoints, rank by rank in one process.

vLLM's parallel linears read their rank and world size when they are built; patching those two
functions builds the layer that rank r of a TP=t run would own. Row-parallel partial outputs are
then summed (what the all-reduce does) and compared with a reference built from the formats core.
A real two-process run on the Wan2.2 model is in tests/omni/test_wan_tp2.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.layers import finish, load, make_layer, run
from vllm_omni_mxfp4.formats import dequantize_dualscale, dequantize_mx, quantize_dualscale, quantize_mx

pytestmark = pytest.mark.omni


@pytest.fixture
def as_rank(monkeypatch):
    import vllm.model_executor.layers.linear as linear

    def set_rank(rank: int, size: int) -> None:
        monkeypatch.setattr(linear, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(linear, "get_tensor_model_parallel_world_size", lambda: size)

    return set_rank


def _data(k, n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = (torch.randn(6, k, generator=g) * torch.exp(torch.randn(6, k, generator=g))).to(torch.bfloat16)
    smooth = torch.exp(0.3 * torch.randn(k, generator=g))
    return w, x, smooth


def _dual_partial_reference(x, smooth, w_deq, k0, k, block=512):
    """What one rank computes: its x slice, zero-padded to whole 512-chunks, dual-quantized."""
    front, back = k0 % block, -(k0 + k) % block
    xs = torch.nn.functional.pad(x[:, k0 : k0 + k], (front, back))
    sm = torch.nn.functional.pad(smooth[k0 : k0 + k], (front, back), value=1.0)
    xq = dequantize_dualscale(*quantize_dualscale(xs, smooth=sm))[:, front : front + k]
    return F.linear(xq, w_deq[:, k0 : k0 + k].float())


@pytest.mark.parametrize("k,tp", [(1536, 2), (2048, 2), (3072, 4)])
def test_offline_dualscale_row_parallel_any_split(vllm_env, as_rank, k, tp):
    """K/TP need not be a multiple of 512 (Wan2.2-A14B ffn.net_2: 13824/2 = 6912)."""
    w, x, smooth = _data(k)
    data, scale, dual = quantize_dualscale((w.float() / smooth).to(torch.bfloat16))
    w_deq = dequantize_dualscale(data, scale, dual)
    spec = {"method": "mxfp4_dualscale", "is_checkpoint_serialized": True, "backend": "emulated"}
    part = k // tp
    total = 0
    for rank in range(tp):
        as_rank(rank, tp)
        layer = make_layer(vllm_env, spec, "row", k=k, n=64, bias=False, prefix="blocks.0.ffn.net_2")
        assert layer.input_size_per_partition == part
        load(layer, "weight", data)
        load(layer, "weight_scale", scale)
        load(layer, "weight_dual_scale", dual.unsqueeze(-1))
        load(layer, "mul_scale", smooth)
        finish(vllm_env, layer)
        assert layer.weight.shape == (64, part // 2)
        assert torch.equal(layer.mul_scale, smooth[rank * part : (rank + 1) * part])
        out = run(vllm_env, layer, x[:, rank * part : (rank + 1) * part])
        want = _dual_partial_reference(x, smooth, w_deq, rank * part, part)
        assert torch.equal(out, want.to(torch.bfloat16)), rank
        total = total + out.float()
    full = F.linear(x.float(), w.float())
    cos = F.cosine_similarity(total.flatten(), full.flatten(), dim=0)
    assert cos > 0.97


def test_online_dualscale_row_parallel_quantizes_like_tp1(vllm_env, as_rank):
    """An unaligned shard quantizes the whole 512-chunks it touches, as TP=1 does."""
    k, tp = 1536, 2
    w, x, _ = _data(k, seed=3)
    data, scale, dual = quantize_dualscale(w)
    spec = {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0, "backend": "emulated"}
    for rank, (g0, g1, c0, c1) in enumerate([(0, 32, 0, 2), (16, 48, 1, 3)]):
        as_rank(rank, tp)
        layer = make_layer(vllm_env, spec, "row", k=k, n=64, bias=False, prefix="blocks.0.ffn.net_2")
        load(layer, "weight", w)
        finish(vllm_env, layer)
        part = k // tp
        assert torch.equal(layer.weight, data[:, rank * part // 2 : (rank + 1) * part // 2])
        assert torch.equal(layer.weight_scale, scale[:, g0:g1])
        assert torch.equal(layer.weight_dual_scale[..., 0], dual[:, c0:c1])


@pytest.mark.parametrize("online", [True, False])
def test_single_scale_row_parallel_sums_to_tp1(vllm_env, as_rank, online):
    k, tp = 1024, 2
    w, x, smooth = _data(k, seed=5)
    data, scale = quantize_mx(w)
    spec = {"method": "mxfp4", "backend": "emulated"}
    if not online:
        spec["is_checkpoint_mxfp4_serialized"] = True
    parts = []
    for rank in range(tp):
        as_rank(rank, tp)
        layer = make_layer(vllm_env, spec, "row", k=k, n=64, bias=False, prefix="blocks.0.attn1.to_out")
        if online:
            load(layer, "weight", w)
        else:
            load(layer, "weight", data)
            load(layer, "weight_scale", scale)
            load(layer, "mul_scale", smooth)
        finish(vllm_env, layer)
        assert torch.equal(layer.weight_scale, scale[:, rank * 16 : (rank + 1) * 16])
        parts.append(run(vllm_env, layer, x[:, rank * 512 : (rank + 1) * 512]).float())
    xs = x if online else x * smooth.to(torch.bfloat16)
    xq = dequantize_mx(*quantize_mx(xs))
    want = F.linear(xq, dequantize_mx(data, scale))
    assert torch.allclose(parts[0] + parts[1], want, rtol=2e-2, atol=2e-2)  # two bf16 roundings
    # Blocks of 32 never straddle a 512-element shard: each rank's part is exact.
    assert torch.equal(
        parts[1], F.linear(xq[:, 512:], dequantize_mx(data, scale)[:, 512:]).to(torch.bfloat16).float()
    )


def test_column_parallel_shards_output_rows(vllm_env, as_rank):
    k, tp = 512, 2
    w, x, _ = _data(k, n=128, seed=7)
    data, scale, dual = quantize_dualscale(w)
    spec = {"method": "mxfp4_dualscale", "is_checkpoint_serialized": True, "backend": "emulated"}
    outs = []
    for rank in range(tp):
        as_rank(rank, tp)
        layer = make_layer(vllm_env, spec, "column", k=k, n=128, bias=False, prefix="blocks.0.ffn.net_0.proj")
        load(layer, "weight", data)
        load(layer, "weight_scale", scale)
        load(layer, "weight_dual_scale", dual.unsqueeze(-1))
        load(layer, "mul_scale", torch.ones(k))
        finish(vllm_env, layer)
        assert layer.weight.shape == (64, 256) and layer.weight_dual_scale.shape == (64, 1, 1)
        outs.append(run(vllm_env, layer, x))
    xq = dequantize_dualscale(*quantize_dualscale(x))
    want = F.linear(xq, dequantize_dualscale(data, scale, dual)).to(torch.bfloat16)
    assert torch.equal(torch.cat(outs, dim=-1), want)
