"""MXFP8 W8A8 Linears (``mxfp8_layers``) in vLLM's own Linear classes: loading checks, bad tensors built
from a valid checkpoint, fused Q/K/V, tensor-parallel shards of the (N, K/32) scale, state dict."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.compare import reference
from tests.support.layers import K, N, build, finish, load, make_layer, make_qkv, run, weights
from vllm_omni_mxfp4.formats import dequantize_mxfp8, quantize_mx, quantize_mxfp8

pytestmark = pytest.mark.omni

PREFIX = "blocks.1.attn2.to_q"
SPEC = {
    "method": "mxfp4",
    "is_checkpoint_mxfp4_serialized": True,
    "mxfp8_layers": [PREFIX],
    "backend": "emulated",
}


def _ckpt(seed=70, n=N, k=K):
    w, b, x = weights(seed, n=n, k=k)
    data, scale = quantize_mxfp8(w)
    return {"weight": data, "weight_scale": scale}, b, x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_loaded_layer_computes_the_reference_and_keeps_the_checkpoint_tensors(vllm_env, dtype):
    ckpt, b, x = _ckpt()
    layer = build(vllm_env, SPEC, ckpt, bias=b, dtype=dtype)
    assert type(layer.quant_method).__name__ == "Mxfp8LinearMethod"
    want = reference(x.to(dtype), dequantize_mxfp8(*ckpt.values()), b, act="fp8", rule="floor")
    assert torch.equal(run(vllm_env, layer, x.to(dtype)), want)
    state = layer.state_dict()
    assert set(state) == {"weight", "weight_scale", "bias"}
    assert torch.equal(state["weight"].view(torch.uint8), ckpt["weight"].view(torch.uint8))
    assert torch.equal(state["weight_scale"], ckpt["weight_scale"])


def _refused(env, name, tensor, spec=SPEC):
    layer = make_layer(env, spec)
    with pytest.raises(ValueError) as info:
        load(layer, name, tensor)
    return str(info.value)


def test_a_nan_code_in_the_weight_is_refused_naming_the_tensor_and_index(vllm_env):
    ckpt, _, _ = _ckpt()
    bad = ckpt["weight"].view(torch.uint8).clone()
    bad[3, 17] = 0xFF
    message = _refused(vllm_env, "weight", bad.view(torch.float8_e4m3fn))
    assert message.startswith(f"{PREFIX}.weight: 1 of {N * K} values break the rule 'e4m3'")
    assert "the first is 0xFF at index [3, 17]" in message


@pytest.mark.parametrize(
    "convert,found",
    [
        (lambda t: t.float().to(torch.bfloat16), "torch.bfloat16 (96, 256), an unquantized weight"),
        (
            lambda t: quantize_mx(t.float())[0],
            "torch.uint8 (96, 128), the packed FP4 bytes of an MXFP4 layer",
        ),
        (lambda t: t[:, :128], "torch.float8_e4m3fn (96, 128)"),
    ],
)
def test_a_weight_of_another_dtype_or_shape_is_refused(vllm_env, convert, found):
    ckpt, _, _ = _ckpt()
    message = _refused(vllm_env, "weight", convert(ckpt["weight"]))
    assert message.startswith(
        f"{PREFIX}.weight: a layer listed in mxfp8_layers loads an MXFP8 weight, float8_e4m3fn"
    )
    assert f"the checkpoint holds {found}" in message


def test_a_scale_of_the_wrong_shape_or_code_is_refused(vllm_env):
    ckpt, _, _ = _ckpt()
    message = _refused(vllm_env, "weight_scale", ckpt["weight_scale"][:, :4])
    assert message == f"{PREFIX}.weight_scale: has shape [96, 4]; expected [96, 8] (N, ceil(K/32))"
    bad = ckpt["weight_scale"].clone()
    bad[5, 2] = 0xFF
    assert "break the rule 'e8m0'" in _refused(vllm_env, "weight_scale", bad)


def test_a_tensor_of_another_format_is_refused(vllm_env):
    message = _refused(vllm_env, "mul_scale", torch.ones(K))
    assert message.startswith(f"A layer listed in mxfp8_layers cannot load {PREFIX}.mul_scale")


def test_fused_qkv_loads_three_mxfp8_pieces_and_refuses_an_mxfp4_piece(vllm_env):
    prefix = "blocks.0.attn1.to_qkv"
    spec = {**SPEC, "mxfp8_layers": [prefix]}
    pieces = {p: _ckpt(80 + i, n=64)[0] for i, p in enumerate("qkv")}
    layer = make_qkv(vllm_env, spec, prefix=prefix, bias=False)
    for p, ckpt in pieces.items():
        for name, t in ckpt.items():
            load(layer, name, t, p)
    finish(vllm_env, layer)
    weight = torch.cat([pieces[p]["weight"].view(torch.uint8) for p in "qkv"])
    assert torch.equal(layer.state_dict()["weight"].view(torch.uint8), weight)
    half = make_qkv(vllm_env, spec, prefix=prefix, bias=False)
    load(half, "weight", pieces["q"]["weight"], "q")
    with pytest.raises(ValueError, match=r"to_qkv.weight \(fused piece 'k'\): .* the packed FP4 bytes"):
        load(half, "weight", quantize_mx(pieces["k"]["weight"].float())[0], "k")


@pytest.mark.parametrize("k,tp", [(256, 2), (192, 4)])
def test_row_parallel_shards_slice_weight_and_scale_and_sum_to_tp1(vllm_env, as_rank, monkeypatch, k, tp):
    """Each rank loads its K range of the (N, K) weight and the scales of the blocks it touches; its
    activations are quantized as TP=1 quantizes the whole row (192/4 = 48 splits blocks: the ranks pad
    and agree on the shared blocks' maxima, here from a stand-in for the all-reduce), and the partial
    outputs sum to TP=1's."""
    from vllm_omni_mxfp4.omni import loading

    ckpt, _, x = _ckpt(90, n=64, k=k)
    x = x.reshape(-1, k).float()
    w = dequantize_mxfp8(ckpt["weight"], ckpt["weight_scale"])
    xq = dequantize_mxfp8(*quantize_mxfp8(x))
    maxima = F.pad(x.abs(), (0, -k % 32)).reshape(x.shape[0], -1, 32).amax(-1)
    shared = []

    def group_max(local):
        shared.append(layer._mx.spec.shared.blocks)
        return maxima[:, shared[-1]].clone()

    monkeypatch.setattr(loading, "tp_reduce_max", group_max)
    part, total = k // tp, 0
    spec = {**SPEC, "mxfp8_layers": ["blocks.0.ffn.net_2"]}
    for rank in range(tp):
        as_rank(rank, tp)
        layer = make_layer(
            vllm_env, spec, "row", k=k, n=64, bias=False, prefix="blocks.0.ffn.net_2", dtype=torch.float32
        )
        for name, t in ckpt.items():
            load(layer, name, t)
        finish(vllm_env, layer)
        lo, hi = rank * part, (rank + 1) * part
        assert torch.equal(layer.weight.view(torch.uint8), ckpt["weight"][:, lo:hi].view(torch.uint8))
        assert torch.equal(layer.weight_scale, ckpt["weight_scale"][:, lo // 32 : -(-hi // 32)])
        out = run(vllm_env, layer, x[:, lo:hi])
        assert torch.allclose(out, F.linear(xq[:, lo:hi], w[:, lo:hi]), rtol=1e-5, atol=1e-5), rank
        total = total + out
    assert bool(shared) == bool(part % 32)
    assert torch.allclose(total, F.linear(xq, w), rtol=1e-4, atol=1e-4)


def test_an_mxfp8_weight_at_a_layer_missing_from_mxfp8_layers_names_the_key(vllm_env):
    ckpt, _, _ = _ckpt()
    spec = {**SPEC, "mxfp8_layers": []}
    message = _refused(vllm_env, "weight", ckpt["weight"], spec)
    assert message.startswith(f"{PREFIX}.weight: numeric weight holds values that are not FP4 E2M1 numbers")
    assert "a float8_e4m3fn weight off that grid is an MXFP8 W8A8 layer's" in message
    assert "mxfp8_layers" not in _refused(vllm_env, "weight", ckpt["weight"].float().to(torch.bfloat16), spec)


def test_column_parallel_shards_take_their_rows_of_weight_and_scale(vllm_env, as_rank):
    ckpt, b, x = _ckpt(95)
    full = build(vllm_env, SPEC, ckpt, bias=b)
    outs = []
    for rank in range(2):
        as_rank(rank, 2)
        layer = build(vllm_env, SPEC, ckpt, bias=b)
        rows = slice(rank * N // 2, (rank + 1) * N // 2)
        assert torch.equal(layer.weight.view(torch.uint8), ckpt["weight"][rows].view(torch.uint8))
        assert torch.equal(layer.weight_scale, ckpt["weight_scale"][rows])
        with vllm_env.context(), torch.no_grad():
            outs.append(layer.quant_method.apply(layer, x, layer.bias))
    assert torch.equal(torch.cat(outs, dim=-1), run(vllm_env, full, x))


def test_an_odd_k_is_held_one_element_a_byte(vllm_env):
    ckpt, b, x = _ckpt(97, k=97)
    layer = build(vllm_env, SPEC, ckpt, bias=b, k=97)
    assert tuple(layer.weight_scale.shape) == (N, 4)  # a zero-padded last block
    want = reference(x, dequantize_mxfp8(*ckpt.values()), b, act="fp8", rule="floor")
    assert torch.equal(run(vllm_env, layer, x), want)
