"""Tensor-parallel sharding of MXFP4 checkpoints, rank by rank in one process.

vLLM's parallel linears read their rank and world size when they are built; patching those two
functions builds the layer that rank r of a TP=t run would own. Row-parallel partial outputs are
then summed (what the all-reduce does) and compared with a reference built from the formats core.
DualScale shards that split a 512-chunk are also run on real TP=2 / TP=4 ranks over gloo
(``run_ranks``), where the ranks agree on the split chunks' activation maxima through the real
all-reduce. Real runs of the Wan2.2 model are in tests/omni/test_wan_tp2.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.compare import assert_within_rounding
from tests.support.layers import finish, load, make_layer, run
from vllm_omni_mxfp4.formats import dequantize_dualscale, dequantize_mx, quantize_dualscale, quantize_mx
from vllm_omni_mxfp4.kernels.emulated import aligned

pytestmark = pytest.mark.omni


def _data(k, n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = (torch.randn(6, k, generator=g) * torch.exp(torch.randn(6, k, generator=g))).to(torch.bfloat16)
    smooth = torch.exp(0.3 * torch.randn(k, generator=g))
    return w, x, smooth


def _dual_partial_reference(x, smooth, w_deq, k0, k, block=512, shared=True):
    """What one rank must compute: TP=1's dual quantization of the whole row (``shared``), cut to
    the rank's K range, times its weight columns; ``shared=False``: the rank's own slice quantized
    alone, zero-padded to whole 512-chunks (what ranks computed before they agreed on block maxima)."""
    if shared:
        xq = dequantize_dualscale(*quantize_dualscale(x, smooth=smooth))[:, k0 : k0 + k]
    else:
        front, back = k0 % block, -(k0 + k) % block
        xs = F.pad(x[:, k0 : k0 + k], (front, back))
        sm = F.pad(smooth[k0 : k0 + k], (front, back), value=1.0)
        xq = dequantize_dualscale(*quantize_dualscale(xs, smooth=sm))[:, front : front + k]
    return F.linear(xq, w_deq[:, k0 : k0 + k].float())


def _block_maxima(x, smooth, block=512):
    """Per-row maxima of |x * smooth| (in x's dtype) over each block of K: what TP=1 sees."""
    xs = (x * smooth.to(x.dtype)).abs().float()
    return F.pad(xs, (0, -xs.shape[1] % block)).reshape(xs.shape[0], -1, block).amax(dim=-1)


def _dual_checkpoint(k, seed=0):
    w, x, smooth = _data(k, seed=seed)
    data, scale, dual = quantize_dualscale((w.float() / smooth).to(torch.bfloat16))
    return (data, scale, dual), x, smooth


def _load_dual_row(env, ckpt, smooth, k, dtype=torch.bfloat16, backend="emulated"):
    data, scale, dual = ckpt
    spec = {"method": "mxfp4_dualscale", "is_checkpoint_serialized": True, "backend": backend}
    layer = make_layer(env, spec, "row", k=k, n=64, bias=False, prefix="blocks.0.ffn.net_2", dtype=dtype)
    load(layer, "weight", data)
    load(layer, "weight_scale", scale)
    load(layer, "weight_dual_scale", dual.unsqueeze(-1))
    load(layer, "mul_scale", smooth)
    finish(env, layer)
    return layer


@pytest.mark.parametrize("k,tp", [(1536, 2), (2048, 2), (3072, 4), (1536, 4), (1280, 2)])
def test_offline_dualscale_row_parallel_any_split(vllm_env, as_rank, monkeypatch, k, tp):
    """K/TP need not be a multiple of 512 (Wan2.2-A14B ffn.net_2: 13824/2 = 6912): each rank's
    partial equals TP=1's quantization cut to its K range, given the group's block maxima (here
    from a stand-in for the all-reduce; tests/omni/test_wan_tp2.py and the gloo test below run the
    real one). K=1536 over TP=4: ranks 1 and 2 pad 384+256 and 256+384 (unequal front/back)."""
    from vllm_omni_mxfp4.omni import loading

    ckpt, x, smooth = _dual_checkpoint(k)
    w_deq = dequantize_dualscale(*ckpt)
    maxima = _block_maxima(x, smooth)
    seen = []

    def group_max(local):  # the all-reduce MAX over the ranks
        layer_blocks = layer._mx.spec.shared.blocks
        assert bool((local <= maxima[:, layer_blocks]).all())
        seen.append(layer_blocks)
        return maxima[:, layer_blocks].clone()

    monkeypatch.setattr(loading, "tp_reduce_max", group_max)
    part, total, bound, differs = k // tp, 0, 0, False
    for rank in range(tp):
        as_rank(rank, tp)
        layer = _load_dual_row(vllm_env, ckpt, smooth, k)
        assert layer.input_size_per_partition == part and layer.weight.shape == (64, part // 2)
        assert torch.equal(layer.mul_scale, smooth[rank * part : (rank + 1) * part])
        out = run(vllm_env, layer, x[:, rank * part : (rank + 1) * part])
        want = _dual_partial_reference(x, smooth, w_deq, rank * part, part)
        assert torch.equal(out, want.to(torch.bfloat16)), rank
        alone = _dual_partial_reference(x, smooth, w_deq, rank * part, part, shared=False)
        differs |= not torch.equal(out, alone.to(torch.bfloat16))
        total, bound = total + out.float(), bound + out.float().abs() * 2.0**-8
    split = any(r * part % 512 for r in range(1, tp))
    assert bool(seen) == split and differs == split  # blocks were shared where split, and it mattered
    tp1 = F.linear(dequantize_dualscale(*quantize_dualscale(x, smooth=smooth)), w_deq)
    assert bool(((total - tp1).abs() <= bound).all())  # only each partial's bf16 output rounding


def test_shared_blocks_geometry_and_refusal():
    from vllm_omni_mxfp4.kernels import SharedBlocks

    def of(k, rank, tp, block=512):
        return SharedBlocks.of("blocks.0.ffn.net_2", k, rank, tp, block, lambda t: t)

    assert of(2048, 0, 2) is None  # every rank boundary on a block edge: nothing to share
    assert (of(1536, 0, 2).blocks, of(1536, 0, 2).first, of(1536, 0, 2).last) == ((1,), None, 0)
    assert (of(1536, 1, 2).first, of(1536, 1, 2).last) == (0, None)
    mid = of(1536, 1, 4)  # cuts at 384, 768, 1152; rank 1 is [384, 768): blocks 0 and 1, both shared
    assert (mid.blocks, mid.first, mid.last) == ((0, 1, 2), 0, 1)
    last = of(1280, 1, 2)  # [640, 1280): its back padding lies past K (zeros at TP=1 too), not shared
    assert (last.blocks, last.first, last.last) == ((1,), 0, None)
    assert of(1040, 0, 2, block=32).blocks == (16,)  # single scale: 520 = 16 blocks of 32 + 8
    with pytest.raises(NotImplementedError, match=r"blocks\.0\.ffn\.net_2: K=1040 split over TP=2 gives 520"):
        of(1040, 0, 2)  # the boundary splits a 32-block inside a 512-chunk


def _dual_rank(rank, world, env, k, backend):
    """One real TP rank: the offline DualScale row-parallel layer, its partial and all-reduced outputs."""
    if backend == "npu":
        from tests.support.fake_torch_npu import fake_torch_npu_installed

        with fake_torch_npu_installed():
            return _dual_rank_outputs(rank, world, env, k, backend)
    return _dual_rank_outputs(rank, world, env, k, backend)


def _dual_rank_outputs(rank, world, env, k, backend):
    ckpt, x, smooth = _dual_checkpoint(k)
    layer = _load_dual_row(env, ckpt, smooth, k, dtype=torch.float32, backend=backend)
    part = k // world
    xs = x[:, rank * part : (rank + 1) * part].float()
    with env.context(), torch.no_grad():
        partial = layer.quant_method.apply(layer, xs)
    reduced = run(env, layer, xs)
    spec = layer._mx.spec
    xsb = xs.to(torch.bfloat16) * smooth[rank * part : (rank + 1) * part].to(torch.bfloat16)
    qdq = aligned(spec, xsb, lambda xp: dequantize_dualscale(*quantize_dualscale(xp)))  # the kernel's step
    return partial.numpy(), reduced.numpy(), qdq.numpy(), (spec.k_pad_front, spec.k_pad_back)


def _dual_ranks(rank, world, env, cases):
    """:func:`_dual_rank` for each ``(k, backend)`` of ``cases`` in turn, in one set of rank processes."""
    return {case: _dual_rank(rank, world, env, *case) for case in cases}


# world -> the (k, backend) cases its ranks run, started once for the module (the fake NPU last).
GLOO_CASES = {2: [(1536, "emulated")], 4: [(1536, "emulated"), (1536, "npu")]}


@pytest.fixture(scope="module")
def gloo_runs():
    """world -> (k, backend) -> rank -> what :func:`_dual_rank` returned there."""
    from tests.support.tp_ranks import run_ranks

    got = {}
    for world, cases in GLOO_CASES.items():
        by_rank = run_ranks(world, _dual_ranks, cases)
        got[world] = {case: {rank: r[case] for rank, r in by_rank.items()} for case in cases}
    return got


@pytest.mark.slow
@pytest.mark.parametrize("k,tp,backend", [(1536, 2, "emulated"), (1536, 4, "emulated"), (1536, 4, "npu")])
def test_dualscale_split_blocks_over_gloo_equal_tp1(gloo_runs, k, tp, backend):
    """Real ranks over gloo agree on the split blocks' maxima (one all-reduce MAX): every rank
    quantizes its activations exactly as TP=1 quantizes the whole row (bit for bit), and its
    partial output is TP=1's cut to its K range up to float32 summation order, float32 callers too."""
    got = gloo_runs[tp][(k, backend)]
    ckpt, x, smooth = _dual_checkpoint(k)
    w_deq = dequantize_dualscale(*ckpt)
    part = k // tp
    xb = x.float().to(torch.bfloat16)  # float32 callers: the dual-level kernels quantize bf16
    if (k, tp) == (1536, 4):
        assert got[1][3] == (384, 256) and got[2][3] == (256, 384)  # unequal front/back padding
    tp1_qdq = dequantize_dualscale(*quantize_dualscale(xb, smooth=smooth))
    total = 0
    for rank, (partial, _, qdq, _) in sorted(got.items()):
        assert torch.equal(torch.from_numpy(qdq), tp1_qdq[:, rank * part : (rank + 1) * part]), rank
        want = _dual_partial_reference(xb, smooth, w_deq, rank * part, part).to(torch.bfloat16)
        assert_within_rounding(torch.from_numpy(partial).to(torch.bfloat16), want)
        total = total + torch.from_numpy(partial)
    for _, reduced, _, _ in got.values():  # vLLM's all-reduce of the partials: the same on every rank
        assert torch.allclose(torch.from_numpy(reduced), total, rtol=1e-6, atol=1e-6)


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
