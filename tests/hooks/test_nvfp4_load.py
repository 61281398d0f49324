"""NVFP4 checkpoints loaded with ``mxfp4``: vLLM-Omni's own Wan2.2 expert, built through the T2V
pipeline's ``_create_transformer`` and loaded by its own loader, from ModelOpt's exports.

Expected bytes come from the independent reference (``tests/support/nvfp4/reference.py``, scalar Python on
the stored tensors); the online model is also compared with the offline ``mxfp4`` checkpoint of the
same bytes (bit for bit) and with the BF16 model of the exact dequant (cosine).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.support.layers import build_expert
from tests.support.nvfp4.checkpoints import (
    build_via_pipeline,
    fixture_tensors,
    model_dir_with,
    reference_mxfp4,
    reference_values,
    variant,
)
from vllm_omni_mxfp4.config import Precision

pytestmark = pytest.mark.omni

EMULATED = {"method": "mxfp4", "backend": "emulated"}
QKV = ("to_q", "to_k", "to_v")


def parts(runtime: str) -> list[str]:
    """The checkpoint layers of a runtime Linear of the tiny Wan expert."""
    if runtime.endswith("attn1.to_qkv"):
        return [runtime.replace("to_qkv", p) for p in QKV]
    return [runtime.replace("to_out", "to_out.0").replace("net_0", "net.0").replace("net_2", "net.2")]


def nvfp4_layers(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k[: -len(".weight_scale_2")] for k in tensors if k.endswith(".weight_scale_2"))


@pytest.fixture(scope="module")
def stored():
    return fixture_tensors("nvfp4")


@pytest.fixture(scope="module")
def values(stored):
    return {layer: reference_values(stored, layer) for layer in nvfp4_layers(stored)}


@pytest.fixture(scope="module")
def online(vllm_env, tmp_path_factory):
    return build_via_pipeline(vllm_env, model_dir_with(tmp_path_factory.mktemp("online"), "nvfp4"), EMULATED)


def linears(model):
    from vllm.model_executor.layers.linear import LinearBase

    return {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}


def forward(env, model):
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(1, 4, 3, 8, 8, generator=g).to(torch.bfloat16)
    ehs = torch.randn(1, 16, 32, generator=g).to(torch.bfloat16)
    with env.context(), torch.no_grad():
        return model(
            hidden_states=hs, timestep=torch.tensor([500]), encoder_hidden_states=ehs, return_dict=False
        )[0]


def bf16_weight_seen(layer) -> torch.Tensor:
    """``W^T + bias`` as a BF16 vLLM Linear computes it (vLLM's CPU GEMM keeps the weight inside its
    kernel): the product with the identity has one nonzero term per output, so it is exact."""
    with torch.no_grad():
        out = layer(torch.eye(layer.input_size_per_partition, dtype=torch.bfloat16))
    return out[0] if isinstance(out, tuple) else out


def expected_seen(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return (weight.float().T + bias.float()).to(torch.bfloat16)


def test_every_nvfp4_linear_holds_the_reference_mxfp4_bytes(online, values):
    from vllm_omni_mxfp4.omni.linear import MxLinearMethod

    found = linears(online)
    assert len(found) == 8
    for name, layer in found.items():
        method = layer.quant_method
        assert isinstance(method, MxLinearMethod) and not method.online, name
        assert method.route.precision is Precision.W4A4, name
        want = [reference_mxfp4(values[p], "mse") for p in parts(name)]
        assert torch.equal(layer.weight.data, torch.cat([w for w, _ in want])), name
        assert torch.equal(layer.weight_scale.data, torch.cat([s for _, s in want])), name


def test_a_per_component_config_serves_the_nvfp4_expert_alike(vllm_env, online, tmp_path):
    """The expert's entry of a per-component config builds the same layers as a flat config: the plan
    replaces that entry only (vLLM-Omni's per-component config has read-only entries, so a new one is
    built for the build)."""
    spec = {"transformer": EMULATED}
    model = build_via_pipeline(vllm_env, model_dir_with(tmp_path, "nvfp4"), spec)
    flat = linears(online)
    for name, layer in linears(model).items():
        assert torch.equal(layer.weight.data, flat[name].weight.data), name
        assert torch.equal(layer.weight_scale.data, flat[name].weight_scale.data), name
    assert len(flat) == len(linears(model)) == 8


def test_plain_linears_get_the_exact_dequant_in_bf16(online, values):
    embedders = [layer for layer in values if layer.startswith("condition_embedder.")]
    assert len(embedders) == 5
    for layer in embedders:
        want = torch.from_numpy(values[layer]).to(torch.bfloat16)
        assert torch.equal(online.get_submodule(layer).weight.data, want), layer


def test_the_load_report_names_every_layer(online, values):
    records = {r["layer"]: r for r in online._mx_nvfp4.records}
    kept = {"patch_embedding", "proj_out", "blocks.0.norm2"} | {
        f"blocks.0.attn{a}.norm_{q}" for a in (1, 2) for q in "qk"
    }
    assert set(records) == set(values) | kept
    for layer, record in records.items():
        if layer in kept:
            assert record["action"] == "keep", record
        elif layer.startswith("blocks."):
            assert record["action"] == "requantize" and record["rule"] == "mse", record
            assert record["precision"] == "w4a4" and record["runtime"] in linears(online), record
            assert 0 < record["rel_rms"] < 0.2 and record["total_blocks"] == values[layer].size // 32
        else:
            assert record["action"] == "dequantize" and "runs in BF16" in record["reason"], record
    assert records["proj_out"]["reason"].startswith("excluded by ignore pattern 'proj_out'")


def _derived_checkpoint(tmp, stored, values, quantized: bool):
    """The fixture with every NVFP4 layer replaced by the reference's MXFP4 bytes (block Linears, when
    ``quantized``) or its exact dequant in BF16, as an offline mxfp4 or a BF16 checkpoint."""

    def edit_tensors(t):
        for layer, v in values.items():
            for suffix in ("weight_scale", "weight_scale_2", "input_scale"):
                t.pop(f"{layer}.{suffix}")
            if quantized and layer.startswith("blocks."):
                t[f"{layer}.weight"], t[f"{layer}.weight_scale"] = reference_mxfp4(v, "mse")
            else:
                t[f"{layer}.weight"] = torch.from_numpy(v).to(torch.bfloat16)

    def edit_config(cfg):
        qc = {"quant_method": "mxfp4", "is_checkpoint_mxfp4_serialized": True}
        cfg.pop("quantization_config")
        if quantized:
            cfg["quantization_config"] = qc

    root = variant(tmp, "nvfp4", config=edit_config, tensors=edit_tensors)
    (root / "transformer" / "hf_quant_config.json").unlink()
    return root


def test_online_equals_the_offline_checkpoint_and_is_close_to_bf16(
    vllm_env, online, stored, values, tmp_path
):
    offline_dir = _derived_checkpoint(tmp_path / "offline", stored, values, quantized=True)
    offline = build_expert(vllm_env, offline_dir, {"backend": "emulated", "method": "mxfp4"})
    out = forward(vllm_env, online)
    assert torch.equal(out, forward(vllm_env, offline))
    bf16 = build_expert(
        vllm_env, _derived_checkpoint(tmp_path / "bf16", stored, values, quantized=False), None
    )
    cos = F.cosine_similarity(out.float().flatten(), forward(vllm_env, bf16).float().flatten(), dim=0)
    assert cos > 0.95, float(cos)


def test_the_rule_is_selectable(vllm_env, values, tmp_path):
    model = build_via_pipeline(
        vllm_env, model_dir_with(tmp_path, "nvfp4"), {**EMULATED, "nvfp4_requant_rule": "floor"}
    )
    layer = model.get_submodule("blocks.0.attn2.to_out")
    want, scales = reference_mxfp4(values["blocks.0.attn2.to_out.0"], "floor")
    assert torch.equal(layer.weight.data, want) and torch.equal(layer.weight_scale.data, scales)
    assert {r["rule"] for r in model._mx_nvfp4.records if "rule" in r} == {"floor"}


def test_swizzled_scales_load_as_the_linear_export(vllm_env, online, tmp_path):
    swizzled = build_via_pipeline(vllm_env, model_dir_with(tmp_path, "swizzled"), EMULATED)
    for name, layer in linears(online).items():
        other = swizzled.get_submodule(name)
        assert torch.equal(layer.weight_scale.data, other.weight_scale.data), name
        assert torch.equal(layer.weight.data, other.weight.data), name


def test_fp8_layer_of_a_mixed_checkpoint_runs_bf16(vllm_env, tmp_path):
    from vllm_omni_mxfp4.omni.linear import CheckedUnquantizedLinearMethod

    model = build_via_pipeline(vllm_env, model_dir_with(tmp_path, "mixed"), EMULATED)
    layer = model.get_submodule("blocks.0.ffn.net_2")
    assert isinstance(layer.quant_method, CheckedUnquantizedLinearMethod)
    assert "FP8" in layer.quant_method.route.reason
    t = fixture_tensors("mixed")
    want = (t["blocks.0.ffn.net.2.weight"].float() * t["blocks.0.ffn.net.2.weight_scale"]).to(torch.bfloat16)
    bias = t["blocks.0.ffn.net.2.bias"]
    assert torch.equal(bf16_weight_seen(layer), expected_seen(want, bias))
    record = next(r for r in model._mx_nvfp4.records if r["layer"] == "blocks.0.ffn.net.2")
    assert record["action"] == "dequantize" and record["algo"] == "FP8"


def test_w4a16_layers_keep_8_bit_activations(vllm_env, tmp_path):
    model = build_via_pipeline(vllm_env, model_dir_with(tmp_path, "w4a16"), EMULATED)
    routes = [layer.quant_method.route for layer in linears(model).values()]
    assert {r.precision for r in routes} == {Precision.W4A8}
    assert all("W4A16_NVFP4" in r.reason for r in routes)
    precisions = {r["precision"] for r in model._mx_nvfp4.records if r["action"] == "requantize"}
    assert precisions == {"w4a8"}


def test_ignored_layers_get_the_exact_dequant(vllm_env, stored, values, tmp_path):
    spec = {**EMULATED, "ignored_layers": ["blocks.0.ffn.net_2"]}
    model = build_via_pipeline(vllm_env, model_dir_with(tmp_path, "nvfp4"), spec)
    layer = model.get_submodule("blocks.0.ffn.net_2")
    assert layer.quant_method.route.precision is Precision.BF16
    want = torch.from_numpy(values["blocks.0.ffn.net.2"]).to(torch.bfloat16)
    bias = stored["blocks.0.ffn.net.2.bias"]
    assert torch.equal(bf16_weight_seen(layer), expected_seen(want, bias))


def _svdquant(t):
    t["blocks.0.attn2.to_k.svdquant_lora_a"] = torch.zeros(4, 64, dtype=torch.bfloat16)


def _convrot(t):
    t["blocks.0.attn1.to_k.comfy_quant"] = torch.tensor(
        list(b'{"format": "convrot_w4a4"}'), dtype=torch.uint8
    )


def _unknown_algo(cfg):
    cfg["quantization_config"]["quant_algo"] = "NVFP4_FUTURE"


REFUSED = {
    "svdquant": ({"tensors": _svdquant}, ["blocks.0.attn2.to_k", "SVDQuant low-rank branch"]),
    "convrot": ({"tensors": _convrot}, ["blocks.0.attn1.to_k", "convrot"]),
    "unknown_algo": ({"config": _unknown_algo}, ["config.json quantization_config", "unknown quant_algo"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_layers_we_cannot_reproduce_fail_the_build_naming_them(vllm_env, tmp_path, case):
    from vllm_omni_mxfp4.sources.nvfp4 import SourceError

    edits, fragments = REFUSED[case]
    with pytest.raises(SourceError) as info:
        build_via_pipeline(vllm_env, variant(tmp_path, "nvfp4", **edits), EMULATED)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_dualscale_is_refused_naming_the_component(vllm_env, tmp_path):
    spec = {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0, "backend": "emulated"}
    with pytest.raises(ValueError, match=r"transformer \(.*config.json.*\) declares an NVFP4 checkpoint"):
        build_via_pipeline(vllm_env, model_dir_with(tmp_path, "nvfp4"), spec)


def test_start_up_keeps_an_nvfp4_config_vllm_omni_cannot_build(vllm_env):
    """vLLM-Omni 0.30 looks compressed-tensors up as 'compressed_tensors' and hands ModelOpt's
    W4A16_NVFP4 to its FP8 config when the engine starts."""
    from vllm_omni.diffusion.data import TransformerConfig

    from tests.support.nvfp4.checkpoints import MODELOPT_FIXTURES
    from tests.support.nvfp4.producers.compressed import ct_config

    config = TransformerConfig.from_dict({"num_layers": 1, "quantization_config": ct_config(["proj_out"])})
    assert config.quant_config is None and config.quant_method == "compressed-tensors"
    assert config.get("num_layers") == 1
    w4a16 = json.loads((MODELOPT_FIXTURES / "w4a16" / "config.json").read_text())
    config = TransformerConfig.from_dict(w4a16)
    assert config.quant_config is None and config.quant_method == "modelopt"
    with pytest.raises(ValueError, match="Unknown quantization method: 'no_such_method'"):
        TransformerConfig.from_dict({"quantization_config": {"quant_method": "no_such_method"}})
