"""How the NPU kernels call torch_npu: arguments, layouts and mutations the semantic fake catches.

Every assertion on the fake's call log lives here; the behavioural comparisons with the emulated
kernels are in ``test_npu_backend.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.fake_torch_npu import FakeNpuError
from tests.support.layers import N, build, run, smooth_vector, weights
from vllm_omni_mxfp4.formats import quantize_dualscale
from vllm_omni_mxfp4.kernels import NpuDual

pytestmark = pytest.mark.omni


def _calls(fake, op):
    return [c for c in fake.calls if c[0] == op]


@pytest.mark.parametrize("alg", [0, 2])
def test_scale_alg_arguments(vllm_env, fake_npu, alg):
    w, b, x = weights(alg + 20)
    layer = build(
        vllm_env, {"method": "mxfp4", "mxfp4_scale_alg": alg, "backend": "npu"}, {"weight": w}, bias=b
    )
    run(vllm_env, layer, x)
    quant = [kw for _, _, kw in _calls(fake_npu, "npu_dynamic_mx_quant")]
    assert quant[-1]["scale_alg"] == alg and quant[-1]["dst_type_max"] == (7.25 if alg == 2 else 0.0)


def test_w4a8_call(vllm_env, fake_npu):
    w, b, x = weights(23, dtype=torch.float16)
    spec = {"method": "mxfp4", "w4a8_fallback_layers": ["blocks.1.attn2.to_q"], "backend": "npu"}
    run(vllm_env, build(vllm_env, spec, {"weight": w}, dtype=torch.float16, bias=b), x)
    _, (x_q, _, _), kw = _calls(fake_npu, "npu_quant_matmul")[-1]
    assert x_q.dtype == torch.float8_e4m3fn and kw["group_sizes"] == [0, 0, 32]
    assert kw["output_dtype"] == torch.bfloat16 and kw["bias"].dtype == torch.bfloat16


def test_w4a8_steps_of_a_uos_layer_quantize_fp8_activations_with_scale_alg_0(vllm_env, fake_npu, monkeypatch):
    """UOS (scale_alg=2) is an FP4 rule: on the layer's W4A8 steps the FP8 activations use FLOOR
    (scale_alg=0), while its A4 steps keep UOS; the fake refuses UOS arguments for FP8."""
    import vllm_omni_mxfp4.kernels.npu as npu_module
    from vllm_omni_mxfp4.steps import denoise_step

    w, b, x = weights(30)
    spec = {"method": "mxfp4", "mxfp4_scale_alg": 2, "w4a8_fallback_steps": [1]}
    emu = build(vllm_env, {**spec, "backend": "emulated"}, {"weight": w}, bias=b)
    npu = build(vllm_env, {**spec, "backend": "npu"}, {"weight": w}, bias=b)
    for step, (dst_type, alg) in enumerate([(fake_npu.float4_e2m1fn_x2, 2), (torch.float8_e4m3fn, 0)]):
        with denoise_step(step):
            assert torch.equal(run(vllm_env, npu, x), run(vllm_env, emu, x)), step
        kw = _calls(fake_npu, "npu_dynamic_mx_quant")[-1][2]
        assert (kw["dst_type"], kw["scale_alg"]) == (dst_type, alg), step
    # A kernel that quantized A8 activations with the layer's UOS arguments is refused.
    real = npu_module.NpuSingle._matmul

    def a8_with_uos(self, x, call):
        quant = self.npu.npu_dynamic_mx_quant
        self.npu.npu_dynamic_mx_quant = lambda t, **kw: quant(
            t, **{**kw, **npu_module.SCALE_ALG_KWARGS["uos"]}
        )
        try:
            return real(self, x, call)
        finally:
            self.npu.npu_dynamic_mx_quant = quant

    monkeypatch.setattr(npu_module.NpuSingle, "_matmul", a8_with_uos)
    with denoise_step(1), pytest.raises(FakeNpuError, match="only for FP4 E2M1"):
        run(vllm_env, npu, x)


def test_dualscale_weight_is_adopted_as_nz_and_activations_padded(vllm_env, fake_npu):
    k = 768
    w, b, x = weights(26, k=k)
    smooth = smooth_vector(k)
    data, scale, dual = quantize_dualscale((w.float() / smooth).to(torch.bfloat16))
    ckpt = {
        "weight": data,
        "weight_scale": scale,
        "weight_dual_scale": dual.unsqueeze(-1),
        "mul_scale": smooth,
    }
    spec = {"method": "mxfp4_dualscale", "is_checkpoint_serialized": True, "backend": "npu"}
    run(vllm_env, build(vllm_env, spec, ckpt, k=k, bias=b), x)
    _, (x_in,), kw = _calls(fake_npu, "npu_dynamic_dual_level_mx_quant")[-1]
    assert kw["smooth_scale"].dtype == torch.bfloat16 and x_in.shape[-1] == 1024  # whole 512-chunks
    online = build(
        vllm_env,
        {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0, "backend": "npu"},
        {"weight": w},
        k=k,
    )
    assert not fake_npu.is_nz(online.weight)  # padded K: the packed parameter stays, the NZ copy is extra
    w1024, _, _ = weights(25, k=1024)
    aligned = build(
        vllm_env,
        {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0, "backend": "npu"},
        {"weight": w1024},
        k=1024,
    )
    assert fake_npu.is_nz(aligned.weight) and aligned.weight.dtype == torch.int8  # no second copy


@pytest.fixture
def a4_call(vllm_env, fake_npu):
    """The npu_quant_matmul call of an A4 layer with an odd scale-group count, and its output."""
    k = 224
    w, b, x = weights(28, k=k)
    layer = build(vllm_env, {"method": "mxfp4", "backend": "npu"}, {"weight": w}, k=k, bias=b)
    out = run(vllm_env, layer, x)
    _, args, kwargs = _calls(fake_npu, "npu_quant_matmul")[-1]
    return layer, args, kwargs, out.reshape(-1, N)


def test_replay_of_the_kernel_call_reproduces_its_output(fake_npu, a4_call):
    _, args, kwargs, out = a4_call
    x2, scale = args[1], args[2]
    assert scale.shape == (4, N, 2) and bool((scale[3, :, 1] == 0).all())  # 7 groups padded to 4 pairs
    assert x2.transpose(0, 1).is_contiguous() and scale.transpose(0, 1).is_contiguous()
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
        x2 = x2.transpose(0, 1)
    elif mutation == "scale_not_transposed":
        scale = scale.transpose(0, 1)
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


def test_uos_arguments_with_scale_alg_0_are_caught(vllm_env, fake_npu, monkeypatch):
    """A kernel passing dst_type_max=7.25 with scale_alg=0 silently gets FLOOR scales: outputs differ."""
    import vllm_omni_mxfp4.kernels.npu as npu_module

    w, b, x = weights(29)
    spec = {"method": "mxfp4", "mxfp4_scale_alg": 2}
    emu = build(vllm_env, {**spec, "backend": "emulated"}, {"weight": w}, bias=b)
    good = build(vllm_env, {**spec, "backend": "npu"}, {"weight": w}, bias=b)
    assert torch.equal(run(vllm_env, good, x), run(vllm_env, emu, x))
    monkeypatch.setitem(npu_module.SCALE_ALG_KWARGS, "uos", {"scale_alg": 0, "dst_type_max": 7.25})
    bad = build(vllm_env, {**spec, "backend": "npu"}, {"weight": w}, bias=b)
    assert not torch.equal(bad.weight_scale, emu.weight_scale)
    assert not torch.equal(run(vllm_env, bad, x), run(vllm_env, emu, x))


def test_a_kernel_that_drops_the_odd_scale_group_is_caught(vllm_env, fake_npu, monkeypatch):
    import vllm_omni_mxfp4.kernels.npu as npu_module

    monkeypatch.setattr(
        npu_module, "to_npu_scale_layout", lambda s: s[..., : s.shape[-1] // 2 * 2].unflatten(-1, (-1, 2))
    )
    w, b, x = weights(30, k=224)
    layer = build(vllm_env, {"method": "mxfp4", "backend": "npu"}, {"weight": w}, k=224, bias=b)
    with pytest.raises(FakeNpuError, match=r"\(m, ceil\(k/64\), 2\)|\(ceil\(k/64\), n, 2\)"):
        run(vllm_env, layer, x)


def test_wrong_dual_level_calls_are_caught(vllm_env, fake_npu):
    k = 1024
    w, b, x = weights(31, k=k)
    spec = {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0, "backend": "npu"}
    layer = build(vllm_env, spec, {"weight": w}, k=k, bias=b)
    out = run(vllm_env, layer, x).reshape(-1, N)
    _, args, kwargs = _calls(fake_npu, "npu_dual_level_quant_matmul")[-1]
    assert torch.equal(fake_npu.npu_dual_level_quant_matmul(*args, **kwargs), out)
    x1, x2, l0, w_l0, l1, w_l1 = args
    packed = NpuDual().nz_to_checkpoint(x2)
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
