"""MXFP8 W8A8 layers next to MXFP4 layers in vLLM-Omni's own Wan2.2 transformer and loader (issue #15).

The tiny model's block 0 is stored as MXFP8 (what msModelSlim's Wan2.2 recipes do to blocks 0-4) and
block 1 as MXFP4, in one offline ``mxfp4`` checkpoint whose ``quantization_config`` lists block 0's
Linears in ``mxfp8_layers``; the expert is built by vLLM-Omni's factory without a quantization
argument (auto-detection) and loaded by its ``DiffusersPipelineLoader``.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.support.compare import ReferenceKernel
from tests.support.layers import (
    build_expert,
    checkpoint_variant,
    exact,
    forward,
    mxfp8_dir,
    quantized_layers,
    set_kernels,
)
from tests.support.metrics import cosine
from vllm_omni_mxfp4.config import Precision

__all__ = ["mxfp8_dir"]  # module fixtures

pytestmark = pytest.mark.omni


@pytest.fixture(scope="module")
def model(vllm_env, mxfp8_dir):
    return build_expert(vllm_env, mxfp8_dir, None)


def test_block_0_runs_mxfp8_w8a8_and_block_1_mxfp4(model):
    layers = quantized_layers(model)
    assert len(layers) == 16
    for name, layer in layers.items():
        method = layer.quant_method
        want = ("mxfp8", Precision.W8A8) if name.startswith("blocks.0.") else ("mxfp4", Precision.W4A4)
        assert (method.method_name, method.route.precision) == want, name
        assert layer.weight.dtype == (torch.float8_e4m3fn if want[0] == "mxfp8" else torch.uint8), name
    assert layers["blocks.0.ffn.net_2"].quant_method.act_scale_rule == "floor"


def test_output_equals_the_reference_and_is_close_to_bf16(vllm_env, tiny_dir, model):
    out = forward(vllm_env, model)
    bf16 = forward(vllm_env, build_expert(vllm_env, tiny_dir, None))
    assert cosine(out, bf16) > 0.99
    set_kernels(model, exact)
    want = forward(vllm_env, model)
    set_kernels(model, ReferenceKernel)
    assert torch.equal(want, forward(vllm_env, model))
    assert cosine(out, want) > 0.9999


def test_state_dict_holds_exactly_the_checkpoint_tensors(mxfp8_dir, model):
    stored = load_file(str(mxfp8_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    state = model.state_dict()
    for name in ("blocks.0.ffn.net_2", "blocks.0.attn2.to_k"):
        ckpt = name.replace("ffn.net_2", "ffn.net.2")
        assert state[f"{name}.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(
            state[f"{name}.weight"].view(torch.uint8), stored[f"{ckpt}.weight"].view(torch.uint8)
        )
        assert torch.equal(state[f"{name}.weight_scale"], stored[f"{ckpt}.weight_scale"])
    qkv = torch.cat([stored[f"blocks.0.attn1.to_{p}.weight"].view(torch.uint8) for p in "qkv"])
    assert torch.equal(state["blocks.0.attn1.to_qkv.weight"].view(torch.uint8), qkv)
    assert not any(k.startswith("blocks.0.") and k.endswith("mul_scale") for k in state)


def test_mxfp8_layers_naming_no_linear_is_refused(vllm_env, mxfp8_dir, tmp_path):
    def misspell(config):
        config["quantization_config"]["mxfp8_layers"].append("blocks.0.attn2.to_kk")

    bad = checkpoint_variant(mxfp8_dir, tmp_path / "bad", config=misspell)
    with pytest.raises(ValueError) as info:
        build_expert(vllm_env, bad, None)
    message = str(info.value)
    assert "mxfp8_layers entry 'blocks.0.attn2.to_kk' matches no Linear" in message
    assert "Did you mean 'blocks.0.attn2.to_k'?" in message


def test_a_fused_qkv_group_half_in_mxfp8_is_refused_naming_the_piece(vllm_env, tiny_dir, mxfp8_dir, tmp_path):
    from vllm_omni_mxfp4.formats import quantize_mx

    original = load_file(str(tiny_dir / "transformer" / "diffusion_pytorch_model.safetensors"))

    def k_in_mxfp4(tensors):
        w = original["blocks.0.attn1.to_k.weight"]
        tensors["blocks.0.attn1.to_k.weight"], tensors["blocks.0.attn1.to_k.weight_scale"] = quantize_mx(w)

    bad = checkpoint_variant(mxfp8_dir, tmp_path / "bad", tensors=k_in_mxfp4)
    with pytest.raises(ValueError) as info:
        build_expert(vllm_env, bad, None)
    message = str(info.value)
    assert "blocks.0.attn1.to_qkv.weight (fused piece 'k')" in message
    assert "the packed FP4 bytes of an MXFP4 layer" in message
    assert "mxfp8_layers" in message


def test_the_checkpoint_block_lists_the_mxfp8_layers(mxfp8_dir):
    qc = json.loads((mxfp8_dir / "transformer" / "config.json").read_text())["quantization_config"]
    assert qc["mxfp8_layers"][:2] == ["blocks.0.attn1.to_out", "blocks.0.attn1.to_qkv"]
    assert len(qc["mxfp8_layers"]) == 8


def test_a_runtime_method_with_w4a8_steps_keeps_the_checkpoints_mxfp8_layers(vllm_env, mxfp8_dir):
    """vLLM-Omni rebuilds an online runtime config from the serialized checkpoint's (storage from the
    checkpoint, W4A8 steps from the runtime): block 0 stays W8A8, the steps apply to block 1 only."""
    model = build_expert(vllm_env, mxfp8_dir, {"method": "mxfp4", "w4a8_fallback_steps": [0]})
    layers = quantized_layers(model)
    route0 = layers["blocks.0.ffn.net_2"].quant_method.route
    assert route0.precision is Precision.W8A8 and route0.a8_steps == ()
    assert "W4A8 fallback steps [0] do not apply to MXFP8 layers" in route0.reason
    assert layers["blocks.1.ffn.net_2"].quant_method.route.a8_steps == (0,)


def test_mxfp8_layers_naming_a_plain_linear_is_refused_at_build(vllm_env, mxfp8_dir, tmp_path):
    def add_proj_out(config):
        config["quantization_config"]["mxfp8_layers"].append("proj_out")

    bad = checkpoint_variant(mxfp8_dir, tmp_path / "bad", config=add_proj_out)
    with pytest.raises(ValueError, match="mxfp8_layers entry 'proj_out' is a plain torch.nn.Linear of the"):
        build_expert(vllm_env, bad, None)
