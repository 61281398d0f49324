"""The online low-rank branch (``svd_rank``): its numerics, its layers, its TP shards and its refusals.

The pair is checked against the optimum a full SVD gives (Eckart-Young), and a layer's output against
a reference built from the formats core: the residual's MXFP4 GEMM plus the pair's product.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.compare import reference
from tests.support.layers import K, activations, finish, load, make_layer, make_qkv, outlier_weight, run
from vllm_omni_mxfp4.config import Mxfp4Config
from vllm_omni_mxfp4.formats import (
    dequantize_dualscale,
    dequantize_mx,
    low_rank_pair,
    quantize_dualscale,
    quantize_mx,
    split_weight,
)
from vllm_omni_mxfp4.omni import build_quant_config

pytestmark = pytest.mark.omni


# ------------------------------------------------------------------------------------ the pair


@pytest.mark.parametrize("rank", [1, 8, 32])
def test_pair_is_near_the_best_rank_r_approximation(rank):
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(rank)) * torch.logspace(0, -2, 256)
    l1, l2 = low_rank_pair(w, rank)
    assert l1.shape == (rank, 256) and l2.shape == (96, rank) and l1.dtype == torch.float32
    s = torch.linalg.svdvals(w.double())
    best = float(s[rank:].square().sum().sqrt())  # Eckart-Young: the error of the best rank-r product
    got = float(torch.linalg.matrix_norm((w - l2 @ l1).double()))
    assert best <= got <= best * 1.01
    torch.testing.assert_close(l1 @ l1.T, torch.eye(rank), atol=1e-4, rtol=0)  # V^T: orthonormal rows


def test_pair_is_a_function_of_the_weight_and_leaves_the_random_state():
    w = outlier_weight()
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    first = low_rank_pair(w, 8)
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(7)  # another global state: the same pair
    second = low_rank_pair(w, 8)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_residual_is_the_weight_minus_the_pair():
    w = outlier_weight()
    l1, l2, residual = split_weight(w, 4)
    assert residual.dtype == w.dtype and residual.shape == w.shape
    assert torch.equal(residual, (w.float() - l2 @ l1).to(w.dtype))
    assert residual.float().abs().amax() < w.float().abs().amax() / 4  # the outliers left with the pair


@pytest.mark.parametrize(
    "weight,rank,match",
    [
        (torch.zeros(8, 64), 9, r"attn\.to_q\.weight: svd_rank 9 must lie in \[1, min\(N, K\)\] = \[1, 8\]"),
        (torch.zeros(8, 64), 0, r"svd_rank 0 must lie in \[1, min\(N, K\)\]"),
        (torch.zeros(64), 1, r"attn\.to_q\.weight: a low-rank branch needs a 2-D weight"),
    ],
)
def test_pair_refuses_impossible_ranks(weight, rank, match):
    with pytest.raises(ValueError, match=match):
        low_rank_pair(weight, rank, "attn.to_q.weight")


def test_pair_refuses_a_non_finite_weight():
    w = outlier_weight().float()
    w[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.net_2\.weight: the weight holds NaN or infinity"):
        low_rank_pair(w, 4, "blocks.0.ffn.net_2.weight")


# ------------------------------------------------------------------------------------ one layer


def _online(env, spec, w, kind="column", **kw):
    layer = make_layer(env, spec, kind, bias=False, **kw)
    load(layer, "weight", w)
    finish(env, layer)
    return layer


def _with_branch(x, w, rank, dual=False):
    """The reference: the residual's quantized GEMM (float32) in ``x``'s dtype, plus the pair's product
    computed in ``x``'s dtype from the pair rounded to it."""
    l1, l2, residual = split_weight(w, rank)
    if dual:
        main = reference(x, dequantize_dualscale(*quantize_dualscale(residual)), None, dual=True)
    else:
        main = reference(x, dequantize_mx(*quantize_mx(residual)), None)
    return main + F.linear(F.linear(x, l1.to(x.dtype)), l2.to(x.dtype))


@pytest.mark.parametrize("kind", ["column", "row", "replicated"])
@pytest.mark.parametrize("method", ["mxfp4", "mxfp4_dualscale"])
def test_online_layer_is_the_quantized_residual_plus_the_pair(vllm_env, kind, method):
    w, x = outlier_weight(), activations()
    spec = {"method": method, "svd_rank": 8, "backend": "emulated"}
    if method == "mxfp4_dualscale":
        spec["num_bf16_fallback_layers"] = 0
    layer = _online(vllm_env, spec, w, kind)
    l1, l2, residual = split_weight(w, 8)
    assert layer.svd_lowrank_l1.dtype == torch.bfloat16 and torch.equal(layer.svd_lowrank_l1, l1.bfloat16())
    assert torch.equal(layer.svd_lowrank_l2, l2.bfloat16())
    quantized = quantize_dualscale(residual) if method == "mxfp4_dualscale" else quantize_mx(residual)
    assert torch.equal(layer.weight, quantized[0]) and torch.equal(layer.weight_scale, quantized[1])
    assert set(layer.state_dict()) >= {"weight", "weight_scale", "svd_lowrank_l1", "svd_lowrank_l2"}
    out = run(vllm_env, layer, x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, _with_branch(x, w, 8, dual=method == "mxfp4_dualscale"))


@pytest.mark.parametrize("method", ["mxfp4", "mxfp4_dualscale"])
def test_branch_takes_the_outliers_out_of_the_error(vllm_env, method):
    """What the branch is for: against the BF16 Linear, rank 8 leaves a fraction of plain MXFP4's error."""
    w, x = outlier_weight(2), activations(3)
    want = F.linear(x.float(), w.float())
    errors = {}
    for rank in (0, 8):
        spec = {"method": method, "svd_rank": rank, "backend": "emulated", "num_bf16_fallback_layers": 0}
        if method == "mxfp4":
            del spec["num_bf16_fallback_layers"]
        layer = _online(vllm_env, spec, w)
        errors[rank] = float((run(vllm_env, layer, x).float() - want).square().mean())
    assert errors[8] < errors[0] / 4, errors


def test_w4a8_steps_keep_the_branch(vllm_env):
    from vllm_omni_mxfp4.steps import denoise_step

    w, x = outlier_weight(4), activations(5)
    spec = {"method": "mxfp4", "svd_rank": 4, "w4a8_fallback_steps": [1], "backend": "emulated"}
    layer = _online(vllm_env, spec, w)
    l1, l2, residual = split_weight(w, 4)
    branch = F.linear(F.linear(x, l1.bfloat16()), l2.bfloat16())
    w_deq = dequantize_mx(*quantize_mx(residual))
    for step, act in ((0, "fp4"), (1, "fp8")):
        with denoise_step(step):
            out = run(vllm_env, layer, x)
        assert torch.equal(out, reference(x, w_deq, None, act=act, w4a8_bf16=act == "fp8") + branch), step


def test_fused_qkv_keeps_a_pair_per_piece(vllm_env):
    pieces = {p: outlier_weight(10 + i, n=64) for i, p in enumerate("qkv")}
    x = activations(11)
    layer = make_qkv(vllm_env, {"method": "mxfp4", "svd_rank": 4, "backend": "emulated"}, bias=False)
    for piece, w in pieces.items():
        load(layer, "weight", w, piece)
    finish(vllm_env, layer)
    assert layer.svd_lowrank_l1.shape == (12, K) and layer.svd_lowrank_l2.shape == (192, 4)
    out = run(vllm_env, layer, x)
    want = torch.cat([_with_branch(x, pieces[p], 4) for p in "qkv"], dim=-1)
    assert torch.equal(out, want)


def test_fused_qkv_from_one_checkpoint_tensor_splits_it_into_pieces(vllm_env):
    pieces = [outlier_weight(20 + i, n=64) for i in range(3)]
    spec = {"method": "mxfp4", "svd_rank": 4, "backend": "emulated"}
    by_piece = make_qkv(vllm_env, spec, bias=False)
    for piece, w in zip("qkv", pieces):
        load(by_piece, "weight", w, piece)
    fused = make_qkv(vllm_env, spec, bias=False)
    load(fused, "weight", torch.cat(pieces))
    for layer in (by_piece, fused):
        finish(vllm_env, layer)
    for name in ("weight", "weight_scale", "svd_lowrank_l1", "svd_lowrank_l2"):
        assert torch.equal(getattr(fused, name), getattr(by_piece, name)), name


# --------------------------------------------------------------------------------- tensor parallel


@pytest.mark.parametrize("method", ["mxfp4", "mxfp4_dualscale"])
def test_row_parallel_ranks_hold_slices_of_tp1s_pair(vllm_env, as_rank, method):
    """Each rank splits the whole weight as TP=1 does and keeps its K columns of L1 and all of L2: its
    partial is its shard of the residual's GEMM plus its share of the branch, and the partials (which
    vLLM's all-reduce sums) add up to TP=1's output. (K splits on 512-chunk edges here; a split chunk's
    shared maxima are tests/omni/test_tensor_parallel.py's.)"""
    k, tp = 2048, 2
    w, x = outlier_weight(30, n=64, k=k), activations(31, k=k).float()
    spec = {"method": method, "svd_rank": 8, "backend": "emulated", "num_bf16_fallback_layers": 0}
    if method == "mxfp4":
        del spec["num_bf16_fallback_layers"]
    plain_spec = {**spec, "svd_rank": 0}
    kw = {"k": k, "n": 64, "prefix": "blocks.0.ffn.net_2", "dtype": torch.float32}
    l1, l2, residual = split_weight(w, 8)
    as_rank(0, 1)
    whole = _online(vllm_env, spec, w, "row", **kw)
    total, part = 0, k // tp
    for rank in range(tp):
        as_rank(rank, tp)
        layer = _online(vllm_env, spec, w, "row", **kw)
        main = run(
            vllm_env,
            _online(vllm_env, plain_spec, residual, "row", **kw),
            x[..., part * rank : part * (rank + 1)],
        )
        cols = slice(rank * part, (rank + 1) * part)
        assert torch.equal(layer.svd_lowrank_l1, whole.svd_lowrank_l1[:, cols])
        assert torch.equal(layer.svd_lowrank_l2, whole.svd_lowrank_l2)
        partial = run(vllm_env, layer, x[..., cols])
        branch = F.linear(F.linear(x[..., cols], l1[:, cols]), l2)  # a float32 layer keeps a float32 pair
        assert torch.equal(partial, main + branch), rank
        total = total + partial
    if method == "mxfp4":  # float32 GEMM outputs: the partials add up to TP=1 up to summation order
        torch.testing.assert_close(total, run(vllm_env, whole, x), rtol=1e-5, atol=1e-5)


def test_column_parallel_ranks_equal_tp1s_rows(vllm_env, as_rank):
    w, x = outlier_weight(40, n=128), activations(41)
    spec = {"method": "mxfp4", "svd_rank": 8, "backend": "emulated"}
    as_rank(0, 1)
    tp1 = run(vllm_env, _online(vllm_env, spec, w, n=128), x)
    outs = []
    for rank in range(2):
        as_rank(rank, 2)
        outs.append(run(vllm_env, _online(vllm_env, spec, w, n=128), x))
    assert torch.equal(torch.cat(outs, dim=-1), tp1)


# ------------------------------------------------------------------------------------- refusals


def test_rank_above_a_piece_is_refused_before_allocation(vllm_env):
    with pytest.raises(
        ValueError, match=r"blocks\.1\.attn2\.to_q: svd_rank 97 exceeds min\(N, K\) = 96 .*\(96, 256\)"
    ):
        make_layer(vllm_env, {"method": "mxfp4", "svd_rank": 97, "backend": "emulated"})
    with pytest.raises(
        ValueError,
        match=r"to_qkv: svd_rank 65 exceeds min\(N, K\) = 64 of its weights \(64, 256\), \(64, 256\)",
    ):
        make_qkv(vllm_env, {"method": "mxfp4", "svd_rank": 65, "backend": "emulated"})


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "mxfp4", "svd_rank": 8, "is_checkpoint_mxfp4_serialized": True},
        {"method": "mxfp4_dualscale", "svd_rank": 8, "is_checkpoint_serialized": True},
    ],
)
def test_svd_rank_on_a_pre_quantized_checkpoint_is_refused(spec):
    with pytest.raises(
        ValueError, match=r"svd_rank 8 computes a low-rank branch from the BF16 weights .*pre-quantized"
    ):
        build_quant_config(spec)


@pytest.mark.parametrize("value", [-1, 2.5, True, "8"])
def test_svd_rank_must_be_a_count(value):
    with pytest.raises(ValueError, match="svd_rank must be a non-negative integer"):
        build_quant_config({"method": "mxfp4", "svd_rank": value})


def test_a_checkpoint_pair_on_an_svd_rank_layer_is_refused(vllm_env):
    layer = make_layer(vllm_env, {"method": "mxfp4", "svd_rank": 4, "backend": "emulated"}, bias=False)
    with pytest.raises(
        ValueError, match=r"blocks\.1\.attn2\.to_q\.svd_lowrank_l1: the checkpoint carries its own"
    ):
        load(layer, "svd_lowrank_l1", torch.zeros(4, K))


def test_a_non_finite_weight_is_refused_by_name(vllm_env):
    w = outlier_weight().clone()
    w[1, 2] = float("inf")
    layer = make_layer(vllm_env, {"method": "mxfp4", "svd_rank": 4, "backend": "emulated"}, bias=False)
    with pytest.raises(ValueError, match=r"blocks\.1\.attn2\.to_q\.weight"):
        load(layer, "weight", w)


def test_svd_rank_zero_adds_nothing(vllm_env):
    layer = _online(vllm_env, {"method": "mxfp4", "backend": "emulated"}, outlier_weight())
    assert not hasattr(layer, "svd_lowrank_l1") and layer._mx.low_rank == 0
    assert "svd_rank" not in Mxfp4Config().to_dict()  # configs without it serialize as before


def test_the_bf16_compute_default_stays_close(vllm_env):
    """The default bf16 GEMM of the emulated kernel with the branch, against the float32 reference."""
    w, x = outlier_weight(50), activations(51)
    layer = _online(vllm_env, {"method": "mxfp4", "svd_rank": 8, "backend": "emulated"}, w, exact=False)
    out = run(vllm_env, layer, x).float()
    torch.testing.assert_close(out, _with_branch(x, w, 8).float(), rtol=2**-6, atol=2e-2)
