"""Proof on the real model: vLLM-Omni's own Wan2.2 transformer, loaded by vLLM-Omni's own loader.

Each config builds the tiny Wan2.2 expert through vLLM-Omni's ``create_transformer_from_config``
(which reconciles with the checkpoint's ``config.json``), loads it with ``DiffusersPipelineLoader``
(which runs ``process_weights_after_loading``), and checks

- the method every Linear got, against the routing rules;
- the output, against a model-level reference: the same model with every quantized Linear computed
  by ``ReferenceBackend`` (below: formats-core quantize + dequantize, float32 GEMM);
- closeness to the BF16 model of the same weights (cosine similarity, reported).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from vllm_omni_mxfp4.backends import EmulatedBackend, MxBackend
from vllm_omni_mxfp4.config import Precision, parse_quantization
from vllm_omni_mxfp4.formats import (
    dequantize_dualscale,
    dequantize_mx,
    quantize_dualscale,
    quantize_mx,
)
from vllm_omni_mxfp4.steps import denoise_step

pytestmark = pytest.mark.omni

COSINES: dict[str, float] = {}


class ReferenceBackend(MxBackend):
    """Model-level reference: the formats core's quantize/dequantize and a float32 GEMM."""

    name = "reference"

    def quantize_weight(self, weight, scale_rule):
        raise AssertionError("the reference only runs forwards")

    def quantize_weight_dualscale(self, weight):
        raise AssertionError("the reference only runs forwards")

    def prepare(self, layer, spec):
        pass

    def linear(self, layer, spec, x, bias, *, a8):
        if spec.has_smooth:
            x = x * layer._mx_smooth.to(x.dtype)
        if spec.dual_scale:
            xq = dequantize_dualscale(*quantize_dualscale(x))
            w = dequantize_dualscale(layer.weight, layer.weight_scale, layer.weight_dual_scale)
        else:
            d, s = quantize_mx(
                x, elem="fp8" if a8 else "fp4", scale_rule="floor" if a8 else spec.act_scale_rule
            )
            xq = dequantize_mx(d, s, elem="fp8" if a8 else "fp4")
            w = dequantize_mx(layer.weight, layer.weight_scale)
        b = None if bias is None else (bias.to(torch.bfloat16) if a8 else bias).float()
        out = F.linear(xq, w, b)
        return (out.to(torch.bfloat16) if a8 else out).to(x.dtype)


@pytest.fixture(scope="module")
def tiny_dir():
    from vllm_omni_mxfp4_demo.tiny import build_tiny_wan

    return build_tiny_wan(2)


def build_expert(env, model_dir, spec, sub="transformer"):
    from vllm.config import LoadConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader
    from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2 import (
        create_transformer_from_config,
        load_transformer_config,
    )
    from vllm_omni.quantization import build_quant_config

    cfg = load_transformer_config(str(model_dir), sub)
    qc = build_quant_config(spec) if spec is not None else None
    with env.context():
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = create_transformer_from_config(cfg, qc, component=sub)
        finally:
            torch.set_default_dtype(old)
        model.weights_sources = [
            DiffusersPipelineLoader.ComponentSource(
                model_or_path=str(model_dir), subfolder=sub, revision=None
            )
        ]
        loader = DiffusersPipelineLoader(LoadConfig(), env.od_config)
        loader.load_weights(model)
        loader._process_weights_after_loading(model, torch.device("cpu"))
    return model.eval()


def inputs():
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(1, 16, 3, 8, 8, generator=g).to(torch.bfloat16)
    ehs = torch.randn(1, 16, 32, generator=g).to(torch.bfloat16)
    return hs, torch.tensor([500]), ehs


def forward(env, model):
    hs, ts, ehs = inputs()
    with env.context(), torch.no_grad():
        return model(hidden_states=hs, timestep=ts, encoder_hidden_states=ehs, return_dict=False)[0]


def quantized_layers(model):
    from vllm_omni_mxfp4.omni.linear import MxLinearMethod

    return {
        n: m for n, m in model.named_modules() if isinstance(getattr(m, "quant_method", None), MxLinearMethod)
    }


def set_backend(model, backend):
    for layer in quantized_layers(model).values():
        layer.quant_method.backend = backend
        backend.prepare(layer, layer._mx_spec)


def check_routing(model, config):
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    from vllm_omni_mxfp4.omni.linear import MxLinearMethod

    linears = {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}
    assert len(linears) == 16  # 2 blocks x (to_qkv, to_out, attn2 q/k/v/out, ffn net_0, net_2)
    for name, layer in linears.items():
        route = config.route(name)
        if route.precision is Precision.BF16:
            assert isinstance(layer.quant_method, UnquantizedLinearMethod), name
        else:
            assert isinstance(layer.quant_method, MxLinearMethod), name
            assert layer.quant_method.route == route, name


def cosine(a, b):
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@pytest.fixture(scope="module")
def bf16_out(vllm_env, tiny_dir):
    return forward(vllm_env, build_expert(vllm_env, tiny_dir, None))


ONLINE = {
    "mxfp4_ocp": ({"method": "mxfp4"}, None, 0.95),
    "mxfp4_uos": ({"method": "mxfp4", "mxfp4_scale_alg": 2}, None, 0.95),
    "w4a8_layers": (
        {"method": "mxfp4", "w4a8_fallback_layers": ["blocks.0.attn1.to_qkv", "blocks.1.ffn.net_2"]},
        None,
        0.95,
    ),
    "w4a8_step": ({"method": "mxfp4", "w4a8_fallback_steps": [0, 7]}, 7, 0.99),
    "a4_step": ({"method": "mxfp4", "w4a8_fallback_steps": [0, 7]}, 3, 0.95),
    "dualscale_online": ({"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 1}, None, 0.95),
}


@pytest.mark.parametrize("name", list(ONLINE))
def test_online_configs_on_the_wan_transformer(vllm_env, tiny_dir, bf16_out, name):
    spec, step, min_cos = ONLINE[name]
    model = build_expert(vllm_env, tiny_dir, {**spec, "backend": "emulated"})
    check_routing(model, parse_quantization(spec))
    assert quantized_layers(model)

    def run():
        if step is None:
            return forward(vllm_env, model)
        with denoise_step(step):
            return forward(vllm_env, model)

    out = run()
    cos = cosine(out, bf16_out)
    COSINES[name] = cos
    assert cos >= min_cos, cos
    set_backend(model, EmulatedBackend(compute_dtype="float32"))
    exact = run()
    set_backend(model, ReferenceBackend())
    assert torch.equal(exact, run())
    assert cosine(out, exact) > 0.9999


def test_w4a4_and_w4a8_differ_and_step_switches(vllm_env, tiny_dir):
    model = build_expert(
        vllm_env, tiny_dir, {"method": "mxfp4", "w4a8_fallback_steps": [1], "backend": "emulated"}
    )
    calls = []
    for layer in quantized_layers(model).values():
        backend = layer.quant_method.backend
        original = backend.linear

        def spy(layer, spec, x, bias, *, a8, _original=original):
            calls.append(a8)
            return _original(layer, spec, x, bias, a8=a8)

        layer.quant_method.backend = type("Spy", (), {"linear": staticmethod(spy)})()
    per_step = []
    for step in range(3):
        calls.clear()
        with denoise_step(step):
            forward(vllm_env, model)
        per_step.append((calls.count(True), calls.count(False)))
    assert per_step == [(0, 16), (16, 0), (0, 16)]


def _write_offline_checkpoint(src, dst, method, *, smooth_layers=()):
    """An offline checkpoint written with the formats core (diffusers names, split Q/K/V)."""
    shutil.copytree(src, dst)
    path = dst / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(path))
    out = {}
    g = torch.Generator().manual_seed(1)
    quantized = set()
    for name, t in tensors.items():
        prefix = name[: -len(".weight")]
        if not (name.endswith(".weight") and name.startswith("blocks.") and t.dim() == 2):
            out[name] = t
            continue
        quantized.add(prefix)
        smooth = None
        if method == "mxfp4_dualscale" or prefix.endswith(smooth_layers):
            smooth = torch.exp(0.2 * torch.randn(t.shape[1], generator=g))
            if ".attn1.to_" in prefix:  # fused Q/K/V share one Smooth tensor
                smooth = torch.exp(0.2 * torch.randn(t.shape[1], generator=torch.Generator().manual_seed(9)))
            out[prefix + ".mul_scale"] = smooth
            t = (t.float() / smooth).to(torch.bfloat16)
        if method == "mxfp4_dualscale":
            data, scale, dual = quantize_dualscale(t)
            out[prefix + ".weight_dual_scale"] = dual.unsqueeze(-1)
        else:
            data, scale = quantize_mx(t)
        out[prefix + ".weight"] = data
        out[prefix + ".weight_scale"] = scale
    save_file(out, str(path))
    config = json.loads((dst / "config.json").read_text())
    if method == "mxfp4":
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "is_checkpoint_mxfp4_serialized": True,
            "ignored_layers": [],
            "require_smooth_scale": False,
        }
    else:
        config["quantization_config"] = {
            "quant_method": "mxfp4_dualscale",
            "is_checkpoint_serialized": True,
            "ignored_layers": [],
        }
    (dst / "config.json").write_text(json.dumps(config))
    return quantized


@pytest.fixture(scope="module")
def offline_dirs(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("offline")
    dirs = {}
    for method, smooth in (
        ("mxfp4", (".attn1.to_q", ".attn1.to_k", ".attn1.to_v", ".ffn.net.2")),
        ("mxfp4_dualscale", ()),
    ):
        model = root / method
        model.mkdir()
        _write_offline_checkpoint(
            tiny_dir / "transformer", model / "transformer", method, smooth_layers=smooth
        )
        shutil.copy(tiny_dir / "model_index.json", model / "model_index.json")
        dirs[method] = model
    return dirs


@pytest.mark.parametrize("method", ["mxfp4", "mxfp4_dualscale"])
def test_offline_checkpoints_are_auto_detected(vllm_env, offline_dirs, bf16_out, method):
    model = build_expert(vllm_env, offline_dirs[method], None)  # no quantization argument
    layers = quantized_layers(model)
    assert len(layers) == 16
    assert all(
        layer.quant_method.method_name == method and not layer.quant_method.online
        for layer in layers.values()
    )
    assert all("weight_scale" in dict(layer.named_parameters()) for layer in layers.values())
    smooth = [n for n, layer in layers.items() if layer._mx_spec.has_smooth]
    if method == "mxfp4":
        assert smooth == [
            "blocks.0.attn1.to_qkv",
            "blocks.0.ffn.net_2",
            "blocks.1.attn1.to_qkv",
            "blocks.1.ffn.net_2",
        ]
    else:
        assert len(smooth) == 16
    set_backend(model, EmulatedBackend())
    out = forward(vllm_env, model)
    COSINES[f"{method}_offline"] = cosine(out, bf16_out)
    assert cosine(out, bf16_out) >= 0.95
    set_backend(model, EmulatedBackend(compute_dtype="float32"))
    exact = forward(vllm_env, model)
    set_backend(model, ReferenceBackend())
    assert torch.equal(exact, forward(vllm_env, model))


def test_runtime_policy_on_offline_checkpoint_keeps_checkpoint_storage(vllm_env, offline_dirs):
    model = build_expert(
        vllm_env, offline_dirs["mxfp4"], {"method": "mxfp4", "w4a8_fallback_steps": [2], "mxfp4_scale_alg": 2}
    )
    layer = quantized_layers(model)["blocks.1.attn2.to_q"]
    assert not layer.quant_method.online and layer.quant_method.route.a8_steps == (2,)
    assert layer._mx_spec.act_scale_rule == "uos"


def test_method_mismatch_with_checkpoint_is_an_error(vllm_env, offline_dirs):
    with pytest.raises(ValueError, match="Pass a matching --quantization flag or omit it"):
        build_expert(vllm_env, offline_dirs["mxfp4_dualscale"], "mxfp4")


def test_per_expert_configs(vllm_env, tiny_dir):
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    spec = {
        "transformer": {"method": "mxfp4", "w4a8_fallback_layers": ["blocks.1.attn2.to_v"]},
        "transformer_2": None,
    }
    high = build_expert(vllm_env, tiny_dir, spec, "transformer")
    low = build_expert(vllm_env, tiny_dir, spec, "transformer_2")
    assert quantized_layers(high)["blocks.1.attn2.to_v"].quant_method.is_w4a8_fallback_layer
    assert not quantized_layers(high)["blocks.1.attn2.to_q"].quant_method.is_w4a8_fallback_layer
    assert all(
        isinstance(m.quant_method, UnquantizedLinearMethod)
        for m in low.modules()
        if isinstance(m, LinearBase)
    )
    dual_for_low = {
        "transformer": "mxfp4",
        "transformer_2": {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0},
    }
    low = build_expert(vllm_env, tiny_dir, dual_for_low, "transformer_2")
    assert {m.quant_method.method_name for m in quantized_layers(low).values()} == {"mxfp4_dualscale"}


def test_disabled_component_refuses_a_quantized_checkpoint(vllm_env, offline_dirs):
    with pytest.raises(ValueError, match="Quantization is disabled for component 'transformer'"):
        build_expert(vllm_env, offline_dirs["mxfp4"], {"transformer": None, "default": "mxfp4"})


def test_unknown_w4a8_layer_is_rejected_by_the_model(vllm_env, tiny_dir):
    with pytest.raises(ValueError, match="attn1.to_qkv"):
        build_expert(vllm_env, tiny_dir, {"method": "mxfp4", "w4a8_fallback_layers": ["blocks.7.attn2.to_q"]})


def test_report_cosines():
    """Prints the cosine similarities measured above (pytest -s shows them)."""
    for name, cos in sorted(COSINES.items()):
        print(f"cosine vs BF16 {name:<20} {cos:.6f}")
