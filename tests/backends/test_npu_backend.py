"""The NPU backend on the semantic torch_npu fake, against the emulated backend (NPU numerics).

The fake's GEMMs dequantize their operands and multiply in float32, as the emulated backend with
``compute_dtype="float32"`` does, so outputs must be bit-identical wherever both multiply the same
(M, K) x (K, N) problem; with K padding (tensor-parallel shards, whole 512-chunks) they agree up
to float32 summation order.
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni_mxfp4.backends import EmulatedBackend, MxLayerSpec
from vllm_omni_mxfp4.formats import quantize_dualscale, quantize_mx
from vllm_omni_mxfp4.steps import denoise_step

from .fake_torch_npu import FakeNpuError
from .harness import K, N, assert_within_rounding, build, run, smooth_vector, weights

pytestmark = pytest.mark.omni


def emulated() -> EmulatedBackend:
    return EmulatedBackend(compute_dtype="float32")


def both(env, npu_backend, spec, ckpt, **kw):
    return build(env, spec, npu_backend, ckpt, **kw), build(env, spec, emulated(), ckpt, **kw)


# ------------------------------------------------------------------------------------- single scale


@pytest.mark.parametrize("alg", [0, 2])
@pytest.mark.parametrize("kind", ["column", "row", "replicated"])
def test_online_mxfp4_equals_emulated(vllm_env, npu_backend, fake_npu, alg, kind):
    w, b, x = weights(alg + 20)
    spec = {"method": "mxfp4", "mxfp4_scale_alg": alg, "backend": "emulated"}
    npu, emu = both(vllm_env, npu_backend, spec, {"weight": w}, kind=kind, bias=b)
    assert torch.equal(npu.weight, emu.weight) and torch.equal(npu.weight_scale, emu.weight_scale)
    assert set(npu.state_dict()) == {"weight", "weight_scale", "bias"}
    assert torch.equal(run(vllm_env, npu, x), run(vllm_env, emu, x))
    quant = [kw for op, _, kw in fake_npu.calls if op == "npu_dynamic_mx_quant"]
    assert quant[-1]["scale_alg"] == alg and quant[-1]["dst_type_max"] == (7.25 if alg == 2 else 0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("smooth", [False, True])
def test_offline_mxfp4_with_smooth_equals_emulated(vllm_env, npu_backend, dtype, smooth):
    w, b, x = weights(21, dtype=dtype)
    data, scale = quantize_mx(w)
    ckpt = {"weight": data, "weight_scale": scale}
    if smooth:
        ckpt["mul_scale"] = smooth_vector(K)
    spec = {"method": "mxfp4", "is_checkpoint_mxfp4_serialized": True, "backend": "emulated"}
    npu, emu = both(vllm_env, npu_backend, spec, ckpt, dtype=dtype, bias=b)
    assert ("_mx_smooth" in dict(npu.named_buffers())) == smooth
    out = run(vllm_env, npu, x)
    assert out.dtype == dtype and torch.equal(out, run(vllm_env, emu, x))
    assert torch.equal(npu.weight, data)  # the packed checkpoint weight is used in place


def test_odd_scale_group_count_is_padded(vllm_env, npu_backend, fake_npu):
    k = 224  # 7 groups of 32
    w, b, x = weights(22, k=k)
    spec = {"method": "mxfp4", "backend": "emulated"}
    npu, emu = both(vllm_env, npu_backend, spec, {"weight": w}, k=k, bias=b)
    assert npu._mx_npu_scale.shape == (N, 4, 2) and bool((npu._mx_npu_scale[:, 3, 1] == 0).all())
    assert torch.equal(run(vllm_env, npu, x), run(vllm_env, emu, x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_w4a8_layer_equals_emulated(vllm_env, npu_backend, fake_npu, dtype):
    w, b, x = weights(23, dtype=dtype)
    spec = {"method": "mxfp4", "w4a8_fallback_layers": ["blocks.1.attn2.to_q"], "backend": "emulated"}
    npu, emu = both(vllm_env, npu_backend, spec, {"weight": w}, dtype=dtype, bias=b)
    out = run(vllm_env, npu, x)
    assert out.dtype == dtype and torch.equal(out, run(vllm_env, emu, x))
    _, (x_q, _, _), kw = [c for c in fake_npu.calls if c[0] == "npu_quant_matmul"][-1]
    assert x_q.dtype == torch.float8_e4m3fn and kw["group_sizes"] == [0, 0, 32]
    assert kw["output_dtype"] == torch.bfloat16 and kw["bias"].dtype == torch.bfloat16


def test_w4a8_steps_switch_per_call(vllm_env, npu_backend):
    w, b, x = weights(24)
    spec = {"method": "mxfp4", "w4a8_fallback_steps": [1], "backend": "emulated"}
    npu, emu = both(vllm_env, npu_backend, spec, {"weight": w}, bias=b)
    outs = []
    for step in range(3):
        with denoise_step(step):
            out = run(vllm_env, npu, x)
            assert torch.equal(out, run(vllm_env, emu, x)), step
            outs.append(out)
    assert not torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


# --------------------------------------------------------------------------------------- dual scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_online_dualscale_equals_emulated(vllm_env, npu_backend, fake_npu, dtype):
    k = 1024
    w, b, x = weights(25, k=k, dtype=dtype)
    spec = {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0, "backend": "emulated"}
    npu, emu = both(vllm_env, npu_backend, spec, {"weight": w}, k=k, dtype=dtype, bias=b)
    for name in ("weight_scale", "weight_dual_scale"):
        assert torch.equal(getattr(npu, name), getattr(emu, name)), name
    # The NZ weight took the parameter's storage; the state dict still holds the packed bytes.
    assert fake_npu.is_nz(npu.weight) and npu.weight.dtype == torch.int8
    state = npu.state_dict()
    assert set(state) == {"weight", "weight_scale", "weight_dual_scale", "bias"}
    assert state["weight"].dtype == torch.uint8 and torch.equal(state["weight"], emu.weight)
    out = run(vllm_env, npu, x)
    assert out.dtype == dtype and torch.equal(out, run(vllm_env, emu, x))


@pytest.mark.parametrize("k", [1024, 768])
def test_offline_dualscale_with_smooth_equals_emulated(vllm_env, npu_backend, fake_npu, k):
    w, b, x = weights(26, k=k)
    smooth = smooth_vector(k)
    data, scale, dual = quantize_dualscale((w.float() / smooth).to(torch.bfloat16))
    ckpt = {
        "weight": data,
        "weight_scale": scale,
        "weight_dual_scale": dual.unsqueeze(-1),
        "mul_scale": smooth,
    }
    spec = {"method": "mxfp4_dualscale", "is_checkpoint_serialized": True, "backend": "emulated"}
    npu, emu = both(vllm_env, npu_backend, spec, ckpt, k=k, bias=b)
    out, want = run(vllm_env, npu, x), run(vllm_env, emu, x)
    _, (x_in,), kw = [c for c in fake_npu.calls if c[0] == "npu_dynamic_dual_level_mx_quant"][-1]
    assert kw["smooth_scale"].dtype == torch.bfloat16 and x_in.shape[-1] == 1024  # whole 512-chunks
    if k == 1024:
        assert torch.equal(out, want)
    else:  # padded to 1024 for the kernel: the same products, summed in another order
        assert_within_rounding(out, want)
    assert torch.equal(npu.state_dict()["weight"], data)


def _plain_layer(spec: MxLayerSpec, ckpt: dict[str, torch.Tensor], smooth=None) -> torch.nn.Module:
    layer = torch.nn.Module()
    for name, t in ckpt.items():
        layer.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
    if smooth is not None:
        layer.register_buffer("_mx_smooth", smooth, persistent=False)
    return layer


@pytest.mark.parametrize("dual", [True, False])
def test_row_parallel_shard_with_k_padding(npu_backend, dual):
    """A shard whose K range straddles scale blocks (Wan ffn.net_2 at TP=2): pads around K."""
    block = 512 if dual else 32
    k_full, k0, k = 3 * block, block // 2, block  # the shard [k0, k0 + k) straddles two blocks
    front, back = k0 % block, -(k0 + k) % block
    g = torch.Generator().manual_seed(27)
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
    spec = MxLayerSpec("blocks.0.ffn.net_2", dual, "floor", k, N, True, k_pad_front=front, k_pad_back=back)
    outs = []
    for backend in (npu_backend, emulated()):
        layer = _plain_layer(spec, ckpt, smooth)
        backend.prepare(layer, spec)
        outs.append(backend.linear(layer, spec, x, None, a8=False))
    assert_within_rounding(*outs)


# ------------------------------------------------------------------------------- wrong calls caught


def _last_call(fake, op):
    return [c for c in fake.calls if c[0] == op][-1]


@pytest.fixture
def a4_call(vllm_env, npu_backend, fake_npu):
    """The npu_quant_matmul call of an A4 layer with an odd scale-group count, and its output."""
    k = 224
    w, b, x = weights(28, k=k)
    layer = build(
        vllm_env, {"method": "mxfp4", "backend": "emulated"}, npu_backend, {"weight": w}, k=k, bias=b
    )
    out = run(vllm_env, layer, x)
    _, args, kwargs = _last_call(fake_npu, "npu_quant_matmul")
    return layer, args, kwargs, out.reshape(-1, N)


def test_replay_of_the_backend_call_reproduces_its_output(fake_npu, a4_call):
    _, args, kwargs, out = a4_call
    assert torch.equal(fake_npu.npu_quant_matmul(*args, **kwargs), out)


@pytest.mark.parametrize(
    "mutation,match",
    [
        ("weight_not_transposed", "has k="),
        ("scale_not_transposed", r"scale must be \(ceil\(k/64\), n, 2\)"),
        ("scale_contiguous_copy", "both be transposed views or both plain"),
        ("odd_groups_unpadded", r"scale must be \(ceil\(k/64\), n, 2\)"),
        ("group_sizes_w4a8", r"group_sizes \[1, 1, 32\]"),
        ("bias_bf16", "MX bias must be float32"),
        ("no_x1_dtype", "x1_dtype=float4_e2m1fn_x2"),
        ("no_scale_dtype", "float8_e8m0fnu"),
    ],
)
def test_a_wrong_npu_quant_matmul_call_is_caught(fake_npu, a4_call, mutation, match):
    layer, (x1, x2, scale), kwargs, _ = a4_call
    kwargs = dict(kwargs)
    if mutation == "weight_not_transposed":
        x2 = layer.weight
    elif mutation == "scale_not_transposed":
        scale = layer._mx_npu_scale
    elif mutation == "scale_contiguous_copy":
        scale = scale.contiguous()
    elif mutation == "odd_groups_unpadded":  # 7 groups: dropping the odd one instead of padding
        scale = layer.weight_scale[:, :6].reshape(N, 3, 2).transpose(0, 1)
    elif mutation == "group_sizes_w4a8":
        kwargs["group_sizes"] = [0, 0, 32]
    elif mutation == "bias_bf16":
        kwargs["bias"] = kwargs["bias"].to(torch.bfloat16)
    elif mutation == "no_x1_dtype":
        kwargs["x1_dtype"] = None
    elif mutation == "no_scale_dtype":
        kwargs["scale_dtype"] = None
    with pytest.raises(FakeNpuError, match=match):
        fake_npu.npu_quant_matmul(x1, x2, scale, **kwargs)


def test_uos_arguments_with_scale_alg_0_are_caught(vllm_env, npu_backend, monkeypatch):
    """A backend passing dst_type_max=7.25 with scale_alg=0 silently gets FLOOR scales: outputs differ."""
    import vllm_omni_mxfp4.backends.npu as npu_module

    w, b, x = weights(29)
    spec = {"method": "mxfp4", "mxfp4_scale_alg": 2, "backend": "emulated"}
    emu = build(vllm_env, spec, emulated(), {"weight": w}, bias=b)
    good = build(vllm_env, spec, npu_backend, {"weight": w}, bias=b)
    assert torch.equal(run(vllm_env, good, x), run(vllm_env, emu, x))
    monkeypatch.setitem(npu_module.SCALE_ALG_KWARGS, "uos", {"scale_alg": 0, "dst_type_max": 7.25})
    bad = build(vllm_env, spec, npu_backend, {"weight": w}, bias=b)
    assert not torch.equal(bad.weight_scale, emu.weight_scale)
    assert not torch.equal(run(vllm_env, bad, x), run(vllm_env, emu, x))


def test_a_backend_that_drops_the_odd_scale_group_is_caught(vllm_env, npu_backend, monkeypatch):
    import vllm_omni_mxfp4.backends.npu as npu_module

    monkeypatch.setattr(
        npu_module, "to_npu_scale_layout", lambda s: s[..., : s.shape[-1] // 2 * 2].unflatten(-1, (-1, 2))
    )
    w, b, x = weights(30, k=224)
    layer = build(
        vllm_env, {"method": "mxfp4", "backend": "emulated"}, npu_backend, {"weight": w}, k=224, bias=b
    )
    with pytest.raises(FakeNpuError, match=r"\(m, ceil\(k/64\), 2\)|\(ceil\(k/64\), n, 2\)"):
        run(vllm_env, layer, x)


def test_wrong_dual_level_calls_are_caught(vllm_env, npu_backend, fake_npu):
    k = 1024
    w, b, x = weights(31, k=k)
    spec = {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0, "backend": "emulated"}
    layer = build(vllm_env, spec, npu_backend, {"weight": w}, k=k, bias=b)
    out = run(vllm_env, layer, x).reshape(-1, N)
    _, args, kwargs = _last_call(fake_npu, "npu_dual_level_quant_matmul")
    assert torch.equal(fake_npu.npu_dual_level_quant_matmul(*args, **kwargs), out)
    x1, x2, l0, w_l0, l1, w_l1 = args
    packed = npu_backend._nz_to_checkpoint(x2)
    with pytest.raises(FakeNpuError, match="must be FRACTAL_NZ"):  # ND weight
        fake_npu.npu_dual_level_quant_matmul(x1, packed, l0, w_l0, l1, w_l1, **kwargs)
    with pytest.raises(FakeNpuError, match="view/reshape/slice of a FRACTAL_NZ"):  # modified after the cast
        fake_npu.npu_dual_level_quant_matmul(x1, x2.view(torch.uint8), l0, w_l0, l1, w_l1, **kwargs)
    with pytest.raises(FakeNpuError, match=r"x2_level0_scale must be float32 \(2, 96\)"):  # not transposed
        fake_npu.npu_dual_level_quant_matmul(
            x1, x2, l0, layer.weight_dual_scale.squeeze(-1), l1, w_l1, **kwargs
        )
    with pytest.raises(FakeNpuError, match="bias must be float32"):
        fake_npu.npu_dual_level_quant_matmul(x1, x2, l0, w_l0, l1, w_l1, bias=b, output_dtype=torch.bfloat16)
    with pytest.raises(FakeNpuError, match="smooth_scale must be"):
        fake_npu.npu_dynamic_dual_level_mx_quant(x.reshape(-1, k), smooth_scale=torch.ones(k))
