"""The two Linear methods on real vLLM Linear layers, emulated kernels, against an independent reference.

The reference (``tests/support/compare.py``) is built from the formats core alone: the dequantized
weight times the quantized-then-dequantized activation, in float32, plus bias, in the caller's dtype.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

from tests.support.compare import reference
from tests.support.layers import K, N, build, env_vars, finish, load, make_layer, make_qkv, run, weights
from vllm_omni_mxfp4.formats import (
    dequantize_dualscale,
    dequantize_mx,
    e2m1_decode,
    quantize_dualscale,
    quantize_mx,
    unpack_fp4,
)
from vllm_omni_mxfp4.omni import build_quant_config
from vllm_omni_mxfp4.steps import denoise_step

pytestmark = pytest.mark.omni


@pytest.mark.parametrize("alg,rule", [(0, "floor"), (2, "uos")])
@pytest.mark.parametrize("kind", ["column", "row", "replicated"])
def test_online_mxfp4_matches_reference_exactly(vllm_env, alg, rule, kind):
    w, b, x = weights(alg)
    layer = make_layer(vllm_env, {"method": "mxfp4", "mxfp4_scale_alg": alg, "backend": "emulated"}, kind)
    assert layer.weight.is_meta  # nothing allocated before loading
    load(layer, "weight", w)
    assert not layer.weight.is_meta and layer.weight.dtype == torch.uint8  # quantized as soon as complete
    load(layer, "bias", b)
    finish(vllm_env, layer)
    data, scale = quantize_mx(w, scale_rule=rule)
    assert torch.equal(layer.weight, data) and torch.equal(layer.weight_scale, scale)
    assert set(layer.state_dict()) == {"weight", "weight_scale", "bias"}
    out = run(vllm_env, layer, x)
    want = reference(x, dequantize_mx(data, scale), b, rule=rule)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 5, N)
    assert torch.equal(out, want)


def test_default_bf16_compute_is_close_to_reference(vllm_env):
    w, b, x = weights(3)
    layer = make_layer(vllm_env, {"method": "mxfp4", "backend": "emulated"}, exact=False)
    load(layer, "weight", w)
    load(layer, "bias", b)
    finish(vllm_env, layer)
    out = run(vllm_env, layer, x).float()
    want = reference(x, dequantize_mx(*quantize_mx(w)), b).float()
    assert torch.allclose(out, want, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_w4a8_layer_uses_fp8_activations_and_bf16_output(vllm_env, dtype):
    w, b, x = weights(5, dtype=dtype)
    spec = {"method": "mxfp4", "w4a8_fallback_layers": ["blocks.1.attn2.to_q"], "backend": "emulated"}
    layer = make_layer(vllm_env, spec, dtype=dtype)
    assert layer.quant_method.is_w4a8_fallback_layer
    load(layer, "weight", w)
    load(layer, "bias", b)
    finish(vllm_env, layer)
    out = run(vllm_env, layer, x)  # no step needed for a layer-listed fallback
    want = reference(x, dequantize_mx(*quantize_mx(w)), b, act="fp8", w4a8_bf16=True)
    assert out.dtype == dtype and torch.equal(out, want)
    a4 = reference(x, dequantize_mx(*quantize_mx(w)), b)
    assert not torch.equal(out, a4)


def test_w4a8_step_fallback_switches_exactly_on_listed_steps(vllm_env):
    w, b, x = weights(6)
    spec = {"method": "mxfp4", "w4a8_fallback_steps": [0, 3], "backend": "emulated"}
    layer = make_layer(vllm_env, spec)
    load(layer, "weight", w)
    load(layer, "bias", b)
    finish(vllm_env, layer)
    w_deq = dequantize_mx(*quantize_mx(w))
    a8 = reference(x, w_deq, b, act="fp8", w4a8_bf16=True)
    a4 = reference(x, w_deq, b)
    for step in range(5):
        with denoise_step(step):
            out = run(vllm_env, layer, x)
        assert torch.equal(out, a8 if step in (0, 3) else a4), step
    with pytest.raises(RuntimeError, match="no denoise step is published"):
        run(vllm_env, layer, x)


def test_vllm_omni_forward_context_publishes_the_step(vllm_env):
    from vllm_omni.diffusion.forward_context import set_forward_context_denoise_step_idx

    w, b, x = weights(7)
    layer = make_layer(vllm_env, {"method": "mxfp4", "w4a8_fallback_steps": [1], "backend": "emulated"})
    load(layer, "weight", w)
    load(layer, "bias", b)
    finish(vllm_env, layer)
    w_deq = dequantize_mx(*quantize_mx(w))
    with vllm_env.context(), torch.no_grad():
        set_forward_context_denoise_step_idx(1)
        assert torch.equal(layer(x), reference(x, w_deq, b, act="fp8", w4a8_bf16=True))
        set_forward_context_denoise_step_idx(2)
        assert torch.equal(layer(x), reference(x, w_deq, b))


@pytest.mark.parametrize("layout", ["packed", "numeric_bf16", "numeric_fp8"])
def test_offline_mxfp4_packed_or_numeric_weights(vllm_env, layout):
    w, b, x = weights(8)
    data, scale = quantize_mx(w)
    if layout == "packed":
        ckpt_w = data
    else:
        numeric = e2m1_decode(unpack_fp4(data))
        ckpt_w = numeric.to(torch.bfloat16 if layout == "numeric_bf16" else torch.float8_e4m3fn)
    spec = {
        "method": "mxfp4",
        "is_checkpoint_mxfp4_serialized": True,
        "mxfp4_scale_alg": 2,
        "backend": "emulated",
    }
    layer = make_layer(vllm_env, spec)
    load(layer, "weight", ckpt_w)
    load(layer, "weight_scale", scale)
    load(layer, "bias", b)
    finish(vllm_env, layer)
    assert torch.equal(layer.weight, data)
    assert set(layer.state_dict()) == {"weight", "weight_scale", "bias"}
    # Offline weights are used as stored; the scale algorithm only changes the A4 activations.
    assert torch.equal(run(vllm_env, layer, x), reference(x, dequantize_mx(data, scale), b, rule="uos"))


def _offline_single(env, w, *, smooth=None, require=False, extra=None):
    data, scale = quantize_mx(w)
    spec = {
        "method": "mxfp4",
        "is_checkpoint_mxfp4_serialized": True,
        "require_smooth_scale": require,
        "backend": "emulated",
        **(extra or {}),
    }
    layer = make_layer(env, spec)
    load(layer, "weight", data)
    load(layer, "weight_scale", scale)
    if smooth is not None:
        load(layer, "mul_scale", smooth)
    return layer, data, scale


def test_offline_smooth_multiplies_activations_before_quantization(vllm_env):
    w, b, x = weights(9)
    smooth = torch.exp(torch.randn(K, generator=torch.Generator().manual_seed(1)))
    layer, data, scale = _offline_single(vllm_env, w, smooth=smooth, require=True)
    load(layer, "bias", b)
    finish(vllm_env, layer)
    assert set(layer.state_dict()) == {"weight", "weight_scale", "mul_scale", "bias"}
    assert torch.equal(layer.mul_scale, smooth)
    out = run(vllm_env, layer, x)
    assert torch.equal(out, reference(x, dequantize_mx(data, scale), b, smooth=smooth))
    assert not torch.equal(out, reference(x, dequantize_mx(data, scale), b))


def test_offline_all_ones_smooth_is_not_applied(vllm_env):
    w, b, x = weights(10)
    layer, data, scale = _offline_single(vllm_env, w, smooth=torch.ones(K))
    load(layer, "bias", b)
    finish(vllm_env, layer)
    assert set(layer.state_dict()) == {"weight", "weight_scale", "mul_scale", "bias"}
    assert torch.equal(run(vllm_env, layer, x), reference(x, dequantize_mx(data, scale), b))


def test_offline_missing_required_tensors_are_named(vllm_env):
    w, _, _ = weights(11)
    layer, _, _ = _offline_single(vllm_env, w, require=True)
    with pytest.raises(ValueError, match=r"blocks\.1\.attn2\.to_q\.mul_scale: required"):
        finish(vllm_env, layer)
    spec = {"method": "mxfp4", "is_checkpoint_mxfp4_serialized": True, "backend": "emulated"}
    layer = make_layer(vllm_env, spec)
    load(layer, "weight", quantize_mx(w)[0])
    with pytest.raises(ValueError, match=r"to_q\.weight_scale: required by offline mxfp4 but missing"):
        finish(vllm_env, layer)


@pytest.mark.parametrize(
    "bad,match",
    [
        (torch.full((K,), float("nan")), r"mul_scale: 256 of 256 values break the rule 'smooth'"),
        (-torch.ones(K), r"mul_scale: .* the first is -1\.0 at index \[0\]"),
        (torch.zeros(K), r"mul_scale: .*'smooth' \(finite values in \[2\^-24, 2\^24\]"),
        (torch.ones(2, K), r"mul_scale: has shape \[2, 256\]; expected \[256\] \(K,\)"),
        (torch.ones(K, dtype=torch.int32), "mul_scale: has dtype I32; expected BF16 or F16 or F32 or F64"),
    ],
)
def test_offline_invalid_smooth_is_rejected_at_load(vllm_env, bad, match):
    w, _, _ = weights(12)
    layer, _, _ = _offline_single(vllm_env, w)
    with pytest.raises(ValueError, match=match):
        load(layer, "mul_scale", bad)


def test_offline_smooth_that_overflows_the_activation_dtype(vllm_env):
    w, _, _ = weights(13, dtype=torch.float16)
    data, scale = quantize_mx(w)
    spec = {"method": "mxfp4", "is_checkpoint_mxfp4_serialized": True, "backend": "emulated"}
    layer = make_layer(vllm_env, spec, dtype=torch.float16)
    load(layer, "weight", data)
    load(layer, "weight_scale", scale)
    smooth = torch.ones(K)
    smooth[7] = 1e6  # finite in float32, Inf in float16
    load(layer, "mul_scale", smooth)
    with pytest.raises(
        ValueError, match=r"mul_scale: .* the first is 1000000\.0 at index \[7\] once converted to .*float16"
    ):
        finish(vllm_env, layer)


def test_single_scale_refuses_dualscale_tensors(vllm_env):
    w, _, _ = weights(14)
    layer, _, _ = _offline_single(vllm_env, w)
    with pytest.raises(
        ValueError,
        match="Single-scale mxfp4 cannot load DualScale tensor "
        r"blocks\.1\.attn2\.to_q\.weight_dual_scale; changing quant_method",
    ):
        load(layer, "weight_dual_scale", torch.ones(N, 1, 1))


def test_offline_rejects_bad_weight_layouts_and_nan_scales(vllm_env):
    w, _, _ = weights(15)
    spec = {"method": "mxfp4", "is_checkpoint_mxfp4_serialized": True, "backend": "emulated"}
    layer = make_layer(vllm_env, spec)
    with pytest.raises(ValueError, match="not FP4 E2M1 numbers"):
        load(layer, "weight", w)  # plain BF16 weights are not FP4 values
    with pytest.raises(
        ValueError, match=r"weight_scale: has shape \[96, 4\]; expected \[96, 8\] \(N, ceil\(K/32\)\)"
    ):
        load(layer, "weight_scale", torch.zeros(N, 4, dtype=torch.uint8))
    data, scale = quantize_mx(w)
    scale[5, 2] = 0xFF
    load(layer, "weight", data)
    with pytest.raises(ValueError, match=r"to_q\.weight_scale: 1 of .* the first is 0xFF at index \[5, 2\]"):
        load(layer, "weight_scale", scale)  # refused at load, before the layer is finished


def test_qkv_fused_loading_and_shared_smooth(vllm_env):
    spec = {"method": "mxfp4", "is_checkpoint_mxfp4_serialized": True, "backend": "emulated"}
    layer = make_qkv(vllm_env, spec)
    g = torch.Generator().manual_seed(2)
    ws = [(torch.randn(64, K, generator=g) * 0.05).to(torch.bfloat16) for _ in range(3)]
    bs = [(torch.randn(64, generator=g) * 0.1).to(torch.bfloat16) for _ in range(3)]
    smooth = torch.exp(torch.randn(K, generator=g))
    for shard, w, b in zip("qkv", ws, bs):
        data, scale = quantize_mx(w)
        load(layer, "weight", data, shard)
        load(layer, "weight_scale", scale, shard)
        load(layer, "mul_scale", smooth, shard)
        load(layer, "bias", b, shard)
    finish(vllm_env, layer)
    w_all = torch.cat(ws)
    x = torch.randn(4, K, generator=g).to(torch.bfloat16)
    want = reference(x, dequantize_mx(*quantize_mx(w_all)), torch.cat(bs), smooth=smooth)
    assert torch.equal(run(vllm_env, layer, x), want)
    other = make_qkv(vllm_env, spec)
    load(other, "mul_scale", smooth, "q")
    with pytest.raises(ValueError, match="Fused Q/K/V must share the same Smooth tensor"):
        load(other, "mul_scale", smooth * 2, "k")


def test_online_qkv_is_quantized_only_once_complete(vllm_env):
    layer = make_qkv(vllm_env, {"method": "mxfp4", "backend": "emulated"}, bias=False)
    g = torch.Generator().manual_seed(4)
    ws = [(torch.randn(64, K, generator=g) * 0.05).to(torch.bfloat16) for _ in range(3)]
    load(layer, "weight", ws[0], "q")
    load(layer, "weight", ws[1], "k")
    assert layer.weight.dtype == torch.bfloat16  # still waiting for v
    with pytest.raises(ValueError, match=r"needs the complete BF16 weight, but 32768 of 49152"):
        finish(vllm_env, layer)
    load(layer, "weight", ws[2], "v")
    assert layer.weight.dtype == torch.uint8
    assert torch.equal(layer.weight, quantize_mx(torch.cat(ws))[0])


def test_online_dualscale_and_leading_bf16_blocks(vllm_env):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    k = 1024
    w, b, x = weights(16, k=k)
    spec = {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 2, "backend": "emulated"}
    early = make_layer(vllm_env, spec, k=k, prefix="blocks.1.ffn.net_2")
    assert isinstance(early.quant_method, UnquantizedLinearMethod)
    layer = make_layer(vllm_env, spec, k=k, prefix="blocks.2.ffn.net_2")
    load(layer, "weight", w)
    load(layer, "bias", b)
    finish(vllm_env, layer)
    data, scale, dual = quantize_dualscale(w)
    assert torch.equal(layer.weight, data) and torch.equal(layer.weight_scale, scale)
    assert torch.equal(layer.weight_dual_scale, dual.unsqueeze(-1))
    assert set(layer.state_dict()) == {"weight", "weight_scale", "weight_dual_scale", "bias"}
    xd, xs, xl0 = quantize_dualscale(x)
    want = F.linear(dequantize_dualscale(xd, xs, xl0), dequantize_dualscale(data, scale, dual), b.float())
    assert torch.equal(run(vllm_env, layer, x), want.to(torch.bfloat16))


def test_offline_dualscale_without_mul_scale_runs_with_identity_smooth(vllm_env):
    """A DualScale layer msModelSlim did not smooth (vLLM-Omni's merge script writes no mul_scale for
    it) computes exactly what msModelSlim's fake-quant Linear computes: x quantized as it comes."""
    k = 1024
    w, b, x = weights(18, k=k)
    data, scale, dual = quantize_dualscale(w)
    spec = {"method": "mxfp4_dualscale", "is_checkpoint_serialized": True, "backend": "emulated"}
    layer = build(
        vllm_env,
        spec,
        {"weight": data, "weight_scale": scale, "weight_dual_scale": dual.unsqueeze(-1)},
        bias=b,
        k=k,
    )
    assert set(layer.state_dict()) == {"weight", "weight_scale", "weight_dual_scale", "bias"}
    xd, xs, xl0 = quantize_dualscale(x)
    want = F.linear(dequantize_dualscale(xd, xs, xl0), dequantize_dualscale(data, scale, dual), b.float())
    assert torch.equal(run(vllm_env, layer, x), want.to(torch.bfloat16))
    ones = build(
        vllm_env, spec, {"weight": data, "weight_scale": scale, "weight_dual_scale": dual.unsqueeze(-1), "mul_scale": torch.ones(k)}, bias=b, k=k
    )  # fmt: skip
    assert torch.equal(run(vllm_env, ones, x), run(vllm_env, layer, x))  # what our merge writes instead


def test_offline_dualscale_requires_its_three_weight_tensors(vllm_env):
    k = 1024
    w, b, x = weights(17, k=k)
    smooth = torch.exp(0.3 * torch.randn(k, generator=torch.Generator().manual_seed(5)))
    data, scale, dual = quantize_dualscale((w.float() / smooth).to(torch.bfloat16))
    spec = {"method": "mxfp4_dualscale", "is_checkpoint_serialized": True, "backend": "emulated"}
    incomplete = make_layer(vllm_env, spec, k=k)
    load(incomplete, "weight", data)
    load(incomplete, "weight_scale", scale)
    with pytest.raises(
        ValueError, match=r"weight_dual_scale: required by offline mxfp4_dualscale but missing"
    ):
        finish(vllm_env, incomplete)
    layer = make_layer(vllm_env, spec, k=k)
    load(layer, "weight", data)
    load(layer, "weight_scale", scale)
    load(layer, "weight_dual_scale", dual.unsqueeze(-1))
    load(layer, "mul_scale", smooth)
    load(layer, "bias", b)
    finish(vllm_env, layer)
    assert set(layer.state_dict()) == {"weight", "weight_scale", "weight_dual_scale", "mul_scale", "bias"}
    xd, xs, xl0 = quantize_dualscale(x, smooth=smooth)
    want = F.linear(dequantize_dualscale(xd, xs, xl0), dequantize_dualscale(data, scale, dual), b.float())
    out = run(vllm_env, layer, x)
    assert torch.equal(out, want.to(torch.bfloat16))
    # Smooth undone by the calibrated weights: close to the unquantized layer.
    dense = F.linear(x.float(), w.float(), b.float())
    cos = F.cosine_similarity(out.float().flatten(), dense.flatten(), dim=0)
    assert cos > 0.97


def test_bf16_routes_get_vllms_unquantized_method(vllm_env):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from vllm_omni_mxfp4.omni.mxfp4 import Mxfp4LinearMethod

    spec = {
        "method": "mxfp4",
        "ignored_layers": ["blocks.1.attn2.to_q"],
        "w4a8_fallback_layers": ["blocks.1.attn2.to_q"],
    }
    assert isinstance(make_layer(vllm_env, spec).quant_method, UnquantizedLinearMethod)  # BF16 beats W4A8
    assert isinstance(
        make_layer(vllm_env, spec, prefix="blocks.1.attn2.to_k").quant_method, Mxfp4LinearMethod
    )


def test_configs_survive_pickling(vllm_env):
    for spec in (
        {"method": "mxfp4", "w4a8_fallback_steps": [1, 2], "mxfp4_scale_alg": 2},
        {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 1, "ignored_layers": ["proj_out"]},
    ):
        qc = build_quant_config(spec)
        back = pickle.loads(pickle.dumps(qc))
        assert type(back) is type(qc) and back.config == qc.config


def test_forward_before_processing_is_a_clear_error(vllm_env):
    spec = {"method": "mxfp4", "is_checkpoint_mxfp4_serialized": True, "backend": "emulated"}
    layer = make_layer(vllm_env, spec)
    data, scale = quantize_mx(weights(18)[0])
    load(layer, "weight", data)
    load(layer, "weight_scale", scale)  # complete, but process_weights_after_loading never ran
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        run(vllm_env, layer, torch.randn(2, K).to(torch.bfloat16))


def test_torch_compile_does_not_recompile_per_step(vllm_env):
    w, b, x = weights(19)
    layer = make_layer(vllm_env, {"method": "mxfp4", "w4a8_fallback_steps": [1], "backend": "emulated"})
    load(layer, "weight", w)
    load(layer, "bias", b)
    finish(vllm_env, layer)
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=counting_backend, fullgraph=True)
    w_deq = dequantize_mx(*quantize_mx(w))
    for step in range(4):
        with denoise_step(step):
            out = run(vllm_env, compiled, x)
        want = reference(x, w_deq, b, act="fp8", w4a8_bf16=True) if step == 1 else reference(x, w_deq, b)
        assert torch.equal(out, want), step
    assert len(compiles) == 1
    targets = {str(n.target) for n in compiles[0].graph.nodes}
    assert "vllm_omni_mxfp4.linear" in targets, targets


def test_w4a4_and_w4a8_share_one_prepared_weight(vllm_env):
    w, b, x = weights(20)
    layer = make_layer(vllm_env, {"method": "mxfp4", "w4a8_fallback_steps": [1], "backend": "emulated"})
    load(layer, "weight", w)
    load(layer, "bias", b)
    finish(vllm_env, layer)
    buffers = {name: t.data_ptr() for name, t in layer.named_buffers()}
    # One prepared weight (the dequantized float32 cache), no per-precision copy.
    assert sum(t.numel() * t.element_size() for t in layer.buffers()) == N * K * 4
    for step in (0, 1, 2):
        with denoise_step(step):
            run(vllm_env, layer, x)
    assert {name: t.data_ptr() for name, t in layer.named_buffers()} == buffers
    assert set(layer.state_dict()) == {"weight", "weight_scale", "bias"}


def test_packed_only_mode_keeps_no_dequantized_copy(vllm_env):
    w, b, x = weights(21)
    with env_vars(VLLM_OMNI_MXFP4_EMULATED_CACHE="0"):
        layer = make_layer(vllm_env, {"method": "mxfp4", "backend": "emulated"})
    load(layer, "weight", w)
    load(layer, "bias", b)
    finish(vllm_env, layer)
    assert list(layer.buffers()) == []
    assert torch.equal(run(vllm_env, layer, x), reference(x, dequantize_mx(*quantize_mx(w)), b))


def test_env_options_are_read_when_a_config_builds_its_kernels(vllm_env):
    """No process-wide cache: a variable set after import reaches the next config's layers."""
    w, b, x = weights(22)
    held, outs = [], []
    for cache in ("1", "0"):
        with env_vars(VLLM_OMNI_MXFP4_EMULATED_CACHE=cache):
            layer = make_layer(vllm_env, {"method": "mxfp4", "backend": "emulated"})
        load(layer, "weight", w)
        load(layer, "bias", b)
        finish(vllm_env, layer)
        held.append(sum(t.numel() for t in layer.buffers()))
        outs.append(run(vllm_env, layer, x))
    assert held == [N * K, 0]
    assert torch.equal(outs[0], outs[1])


def test_method_class_is_wired_without_importing_the_method_modules():
    """Importing only the config wrappers and asking for a method works (no import side effect)."""
    import subprocess
    import sys

    code = (
        "from vllm.model_executor.layers.linear import LinearBase\n"
        "from vllm_omni_mxfp4.config import Mxfp4Config\n"
        "from vllm_omni_mxfp4.omni.quant_config import Mxfp4QuantizationConfig\n"
        "layer = LinearBase.__new__(LinearBase)\n"
        "method = Mxfp4QuantizationConfig(Mxfp4Config()).get_quant_method(layer, 'blocks.0.attn1.to_qkv')\n"
        "print(type(method).__name__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "Mxfp4LinearMethod"


def test_dropped_layers_leave_no_handle_behind(vllm_env):
    import gc

    from vllm_omni_mxfp4.omni import linear

    layers = [make_layer(vllm_env, {"method": "mxfp4", "backend": "emulated"}) for _ in range(3)]
    handles = {layer._mx.handle for layer in layers}
    assert handles <= set(linear._LAYERS)
    del layers
    gc.collect()
    assert not handles & set(linear._LAYERS)
