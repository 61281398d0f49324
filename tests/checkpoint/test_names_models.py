"""Runtime names derived from vLLM-Omni's own model classes (``vllm_omni_mxfp4.models``), against facts
written by hand from reading vLLM-Omni 0.30's model code (``packed_modules_mapping``, ``load_weights``,
the ``prefix`` each Linear hands its quantization config, the Linears built with ``quant_config=None``).
"""

from __future__ import annotations

import json

import pytest

from vllm_omni_mxfp4.checkpoint import CheckpointError
from vllm_omni_mxfp4.models.names import DIFFUSERS_EXPORT_NAMES, MODULE, WAN_EXPORT_NAMES, ModelNames
from vllm_omni_mxfp4.models.wan import LINEAR
from vllm_omni_mxfp4.safetensors_io import diffusers_archive

pytest.importorskip("vllm_omni")


def _derived(directory, pipeline: str, export_names: str) -> ModelNames:
    from vllm_omni_mxfp4.models import derive_names

    config = json.loads((directory / "config.json").read_text())
    tensors = {name: (ref.dtype, ref.shape) for name, ref in diffusers_archive(directory).items()}
    return ModelNames.from_dict(derive_names(pipeline, config["_class_name"], config, tensors), export_names)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> ModelNames:
    from tests.support.qwen_image import PIPELINE, build_pipeline

    root = tmp_path_factory.mktemp("qwen") / "pipe"
    build_pipeline(root)
    return _derived(root / "transformer", PIPELINE, DIFFUSERS_EXPORT_NAMES)


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> ModelNames:
    from .producer import build_pipeline

    root = tmp_path_factory.mktemp("wan") / "pipe"
    build_pipeline(root, transformers=("transformer",))
    return _derived(root / "transformer", "WanPipeline", WAN_EXPORT_NAMES)


BLOCK = "transformer_blocks.1"


def test_qwen_fused_layers_are_the_models_packed_modules(qwen):
    # packed_modules_mapping: to_qkv <- to_q, to_k, to_v; add_kv_proj <- add_q_proj, add_k_proj, add_v_proj
    assert [qwen.fused_piece(f"{BLOCK}.attn.to_{c}") for c in "qkv"] == [
        (f"{BLOCK}.attn.to_qkv", i) for i in range(3)
    ]
    assert [qwen.fused_piece(f"{BLOCK}.attn.add_{c}_proj") for c in "qkv"] == [
        (f"{BLOCK}.attn.add_kv_proj", i) for i in range(3)
    ]
    for layer in ("attn.to_out.0", "attn.to_add_out", "img_mlp.net.2", "txt_mlp.net.0.proj", "img_mod.1"):
        assert qwen.fused_piece(f"{BLOCK}.{layer}") is None


def test_qwen_runtime_names_are_the_prefixes_its_linears_see(qwen):
    # to_out is the module attn.to_out, built with prefix attn.to_out.0: ignored_layers must say .0
    assert qwen.runtime_layer_name(f"{BLOCK}.attn.to_out.0") == f"{BLOCK}.attn.to_out.0"
    assert qwen.runtime_layer_name(f"{BLOCK}.attn.to_k") == f"{BLOCK}.attn.to_qkv"
    assert qwen.runtime_layer_name(f"{BLOCK}.txt_mlp.net.2") == f"{BLOCK}.txt_mlp.net.2"
    assert qwen.runtime_layer_name("proj_out") == "proj_out"


def test_qwen_linears_built_without_a_quant_config_are_not_quantizable(qwen):
    # img_mod.1, img_in, txt_in, norm_out.linear, proj_out, the timestep MLP: quant_config=None;
    # txt_mod.1: safe_quant_config(), None for every method but INC
    bf16 = ["img_in", "txt_in", "norm_out.linear", "proj_out", f"{BLOCK}.img_mod.1", f"{BLOCK}.txt_mod.1"]
    bf16 += ["time_text_embed.timestep_embedder.linear_1"]
    assert not any(qwen.is_runtime_quantizable(layer) for layer in bf16)
    quantized = ["attn.to_q", "attn.add_v_proj", "attn.to_out.0", "attn.to_add_out", "img_mlp.net.0.proj"]
    quantized += ["img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]
    assert all(qwen.is_runtime_quantizable(f"{BLOCK}.{layer}") for layer in quantized)


def test_qwen_tensor_places(qwen):
    assert qwen.parse_diffusers("norm_out.linear.bias").kind == LINEAR
    assert qwen.parse_diffusers(f"{BLOCK}.attn.to_q.weight_scale").layer == f"{BLOCK}.attn.to_q"
    place = qwen.parse_diffusers(f"{BLOCK}.attn.norm_q.weight")
    assert (place.layer, place.kind, place.block) == (f"{BLOCK}.attn.norm_q", MODULE, 1)
    with pytest.raises(
        CheckpointError, match=r"'transformer_blocks\.1\.attn\.to_z\.weight'.*QwenImageTransformer2DModel"
    ):
        qwen.parse_diffusers(f"{BLOCK}.attn.to_z.weight")


def test_a_module_called_linear_is_not_a_smooth_wrapper(qwen):
    assert qwen.strip_smooth_wrapper("norm_out.linear.bias") == ("norm_out.linear.bias", False)
    assert qwen.strip_smooth_wrapper(f"{BLOCK}.img_mlp.net.2.linear.weight") == (
        f"{BLOCK}.img_mlp.net.2.weight",
        True,
    )
    assert qwen.strip_smooth_wrapper(f"{BLOCK}.img_mlp.net.2.div.mul_scale") == (
        f"{BLOCK}.img_mlp.net.2.mul_scale",
        True,
    )


def test_a_tensor_the_model_does_not_load_is_refused(qwen):
    qwen.check_loaded(f"{BLOCK}.attn.to_q.weight", "here")
    with pytest.raises(
        CheckpointError,
        match=r"here: original tensor 'pos_embed\.freqs' is not loaded by vLLM-Omni's QwenImageTransformer2DModel",
    ):
        qwen.check_loaded("pos_embed.freqs", "here")


def test_wan_fuses_self_attention_only(wan):
    # stacked_params_mapping: .attn1.to_qkv <- .attn1.to_q/k/v; attn2 (cross-attention) stays separate
    assert [wan.fused_piece(f"blocks.0.attn1.to_{c}") for c in "qkv"] == [
        ("blocks.0.attn1.to_qkv", i) for i in range(3)
    ]
    assert wan.fused_piece("blocks.0.attn2.to_q") is None
    assert wan.runtime_layer_name("blocks.0.attn2.to_q") == "blocks.0.attn2.to_q"


def test_wan_runtime_names_follow_its_loader(wan):
    # load_weights: .ffn.net.0. -> .ffn.net_0., .ffn.net.2. -> .ffn.net_2., .to_out.0. -> .to_out.
    assert wan.runtime_layer_name("blocks.0.ffn.net.0.proj") == "blocks.0.ffn.net_0.proj"
    assert wan.runtime_layer_name("blocks.0.ffn.net.2") == "blocks.0.ffn.net_2"
    assert wan.runtime_layer_name("blocks.0.attn1.to_out.0") == "blocks.0.attn1.to_out"
    # condition embedders and proj_out are plain nn.Linear: BF16, named by module path
    assert not wan.is_runtime_quantizable("condition_embedder.time_proj")
    assert wan.runtime_layer_name("proj_out") == "proj_out"
    assert wan.is_runtime_quantizable("blocks.0.attn2.to_out.0")


def test_wan_export_names_use_the_exact_original_table(wan):
    assert (
        wan.export_to_diffusers("blocks.0.self_attn.q.weight_scale").name
        == "blocks.0.attn1.to_q.weight_scale"
    )
    assert wan.diffusers_to_export("blocks.0.norm3.weight") == "blocks.0.norm2.weight"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"tensors": {}, "linears": {}}, r"lacks \['model_class'\]"),
        ({"model_class": "X", "tensors": [], "linears": {}}, "dict tensors/linears"),
    ],
)
def test_name_data_that_is_not_derived_is_refused(data, message):
    with pytest.raises(CheckpointError, match=message):
        ModelNames.from_dict(data, DIFFUSERS_EXPORT_NAMES)
    with pytest.raises(CheckpointError, match="export naming 'hf'"):
        ModelNames.from_dict({"model_class": "X", "tensors": {}, "linears": {}}, "hf")


def test_rotation_and_fa3_records_name_their_attention(qwen, wan):
    # Qwen-Image hangs q_rot/k_rot and FA3 on the block; its joint Q/K are image and text projections
    assert qwen.attention(BLOCK) == (
        f"{BLOCK}.attn",
        [f"{BLOCK}.attn.add_k_proj", f"{BLOCK}.attn.add_q_proj", f"{BLOCK}.attn.to_k", f"{BLOCK}.attn.to_q"],
    )
    assert wan.attention("blocks.0.self_attn") == (
        "blocks.0.attn1",
        ["blocks.0.attn1.to_k", "blocks.0.attn1.to_q"],
    )
    assert wan.attention("blocks.0.cross_attn") == (
        "blocks.0.attn2",
        ["blocks.0.attn2.to_k", "blocks.0.attn2.to_q"],
    )
    with pytest.raises(CheckpointError, match=r"'blocks\.0\.ffn' holds no attention Q/K projection"):
        wan.attention("blocks.0.ffn")
