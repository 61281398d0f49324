"""Proof on the real model: vLLM-Omni's own Wan2.2 transformer, loaded by vLLM-Omni's own loader.

Each config builds the tiny Wan2.2 expert through vLLM-Omni's ``create_transformer_from_config``
(which reconciles with the checkpoint's ``config.json``), loads it with ``DiffusersPipelineLoader``
(which runs ``process_weights_after_loading``), and checks

- the method every Linear got, against the routing rules;
- the output, against a model-level reference: the same model with every quantized Linear computed
  by ``ReferenceKernel`` (``tests/support/compare.py``: formats-core quantize + dequantize, float32
  GEMM);
- closeness to the BF16 model of the same weights (cosine similarity, reported).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.compare import ReferenceKernel
from tests.support.layers import (
    build_expert,
    emulated,
    env_vars,
    exact,
    forward,
    offline_dirs,
    quantized_layers,
    set_kernels,
)
from tests.support.metrics import cosine
from vllm_omni_mxfp4.config import Precision, parse_quantization
from vllm_omni_mxfp4.steps import denoise_step

__all__ = ["offline_dirs"]  # module fixtures, shared with tests/backends

pytestmark = pytest.mark.omni

COSINES: dict[str, float] = {}


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
    "mxfp4_svd_rank": ({"method": "mxfp4", "svd_rank": 16}, None, 0.95),
    "dualscale_svd_rank": (
        {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 1, "svd_rank": 16},
        None,
        0.95,
    ),
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
    set_kernels(model, exact)
    want = run()
    set_kernels(model, ReferenceKernel)
    assert torch.equal(want, run())
    assert cosine(out, want) > 0.9999


@pytest.mark.parametrize("method", ["mxfp4", "mxfp4_dualscale"])
def test_svd_rank_gives_every_quantized_linear_a_pair_and_moves_closer_to_bf16(
    vllm_env, tiny_dir, bf16_out, method
):
    """Through vLLM-Omni's own config parsing, factory and loader: each quantized Linear holds a pair
    per checkpoint piece (Q, K and V of the fused self-attention each their own), BF16 Linears none,
    and the output is closer to the BF16 model's than without the branch."""
    spec = {"method": method, "backend": "emulated"}
    if method == "mxfp4_dualscale":
        spec["num_bf16_fallback_layers"] = 1
    plain = cosine(forward(vllm_env, build_expert(vllm_env, tiny_dir, spec)), bf16_out)
    model = build_expert(vllm_env, tiny_dir, {**spec, "svd_rank": 16})
    layers = quantized_layers(model)
    for name, layer in layers.items():
        pieces = 3 if name.endswith("to_qkv") else 1
        assert layer.svd_lowrank_l1.shape == (pieces * 16, layer.input_size_per_partition), name
        assert layer.svd_lowrank_l2.shape == (layer.output_size_per_partition, 16), name
    others = [n for n, m in model.named_modules() if hasattr(m, "quant_method") and n not in layers]
    assert all(not hasattr(model.get_submodule(n), "svd_lowrank_l1") for n in others)
    assert cosine(forward(vllm_env, model), bf16_out) > plain


def test_w4a4_and_w4a8_differ_and_step_switches(vllm_env, tiny_dir, tmp_path):
    model = build_expert(
        vllm_env, tiny_dir, {"method": "mxfp4", "w4a8_fallback_steps": [1], "backend": "emulated"}
    )
    trace = tmp_path / "trace.jsonl"
    with env_vars(VLLM_OMNI_MXFP4_TRACE_FILE=str(trace)):
        for step in range(3):
            with denoise_step(step):
                forward(vllm_env, model)
    calls = [json.loads(line) for line in trace.read_text().splitlines()]
    per_step = [
        tuple(sum(c["step"] == step and c["precision"] == p for c in calls) for p in ("w4a8", "w4a4"))
        for step in range(3)
    ]
    assert per_step == [(0, 16), (16, 0), (0, 16)]


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
    smooth = [n for n, layer in layers.items() if "mul_scale" in layer.state_dict()]
    if method == "mxfp4":
        assert smooth == [
            "blocks.0.attn1.to_qkv",
            "blocks.0.ffn.net_2",
            "blocks.1.attn1.to_qkv",
            "blocks.1.ffn.net_2",
        ]
    else:
        assert len(smooth) == 16
    set_kernels(model, emulated)
    out = forward(vllm_env, model)
    COSINES[f"{method}_offline"] = cosine(out, bf16_out)
    assert cosine(out, bf16_out) >= 0.95
    set_kernels(model, exact)
    want = forward(vllm_env, model)
    set_kernels(model, ReferenceKernel)
    assert torch.equal(want, forward(vllm_env, model))


def test_runtime_policy_on_offline_checkpoint_keeps_checkpoint_storage(vllm_env, offline_dirs):
    model = build_expert(
        vllm_env, offline_dirs["mxfp4"], {"method": "mxfp4", "w4a8_fallback_steps": [2], "mxfp4_scale_alg": 2}
    )
    layer = quantized_layers(model)["blocks.1.attn2.to_q"]
    assert not layer.quant_method.online and layer.quant_method.route.a8_steps == (2,)
    assert layer.quant_method.act_scale_rule == "uos"


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
