"""The Wan2.2 name tables against golden lists written from diffusers' conversion script and the runtime
(the runtime side of the merge is derived from vLLM-Omni's classes: test_names_models.py)."""

from __future__ import annotations

import pytest

from vllm_omni_mxfp4.checkpoint import CheckpointError
from vllm_omni_mxfp4.config.keys import layer_order
from vllm_omni_mxfp4.models.wan import (
    diffusers_to_wan,
    parse_diffusers,
    runtime_layer_name,
    strip_smooth_wrapper,
    wan_to_diffusers,
)

# (original Wan, diffusers): every key family of scripts/convert_wan_to_diffusers.py, written by hand.
GOLDEN = [
    ("patch_embedding.weight", "patch_embedding.weight"),
    ("patch_embedding.bias", "patch_embedding.bias"),
    ("text_embedding.0.weight", "condition_embedder.text_embedder.linear_1.weight"),
    ("text_embedding.2.bias", "condition_embedder.text_embedder.linear_2.bias"),
    ("time_embedding.0.weight", "condition_embedder.time_embedder.linear_1.weight"),
    ("time_embedding.2.weight", "condition_embedder.time_embedder.linear_2.weight"),
    ("time_projection.1.weight", "condition_embedder.time_proj.weight"),
    ("time_projection.1.bias", "condition_embedder.time_proj.bias"),
    ("head.head.weight", "proj_out.weight"),
    ("head.head.bias", "proj_out.bias"),
    ("head.modulation", "scale_shift_table"),
    ("img_emb.proj.0.weight", "condition_embedder.image_embedder.norm1.weight"),
    ("img_emb.proj.1.weight", "condition_embedder.image_embedder.ff.net.0.proj.weight"),
    ("img_emb.proj.3.bias", "condition_embedder.image_embedder.ff.net.2.bias"),
    ("img_emb.proj.4.bias", "condition_embedder.image_embedder.norm2.bias"),
    ("img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"),
    ("blocks.0.modulation", "blocks.0.scale_shift_table"),
    ("blocks.0.self_attn.q.weight", "blocks.0.attn1.to_q.weight"),
    ("blocks.0.self_attn.k.bias", "blocks.0.attn1.to_k.bias"),
    ("blocks.0.self_attn.v.weight", "blocks.0.attn1.to_v.weight"),
    ("blocks.0.self_attn.o.weight", "blocks.0.attn1.to_out.0.weight"),
    ("blocks.0.self_attn.norm_q.weight", "blocks.0.attn1.norm_q.weight"),
    ("blocks.0.self_attn.norm_k.weight", "blocks.0.attn1.norm_k.weight"),
    ("blocks.7.cross_attn.q.weight", "blocks.7.attn2.to_q.weight"),
    ("blocks.7.cross_attn.k.weight", "blocks.7.attn2.to_k.weight"),
    ("blocks.7.cross_attn.v.bias", "blocks.7.attn2.to_v.bias"),
    ("blocks.7.cross_attn.o.bias", "blocks.7.attn2.to_out.0.bias"),
    ("blocks.7.cross_attn.norm_q.weight", "blocks.7.attn2.norm_q.weight"),
    ("blocks.7.cross_attn.norm_k.weight", "blocks.7.attn2.norm_k.weight"),
    ("blocks.7.cross_attn.k_img.weight", "blocks.7.attn2.add_k_proj.weight"),
    ("blocks.7.cross_attn.v_img.bias", "blocks.7.attn2.add_v_proj.bias"),
    ("blocks.7.cross_attn.norm_k_img.weight", "blocks.7.attn2.norm_added_k.weight"),
    # the original applies norm1, norm3 (affine, before cross-attention), norm2; diffusers numbers in order
    ("blocks.12.norm3.weight", "blocks.12.norm2.weight"),
    ("blocks.12.norm3.bias", "blocks.12.norm2.bias"),
    ("blocks.12.norm2.weight", "blocks.12.norm3.weight"),
    ("blocks.39.ffn.0.weight", "blocks.39.ffn.net.0.proj.weight"),
    ("blocks.39.ffn.2.bias", "blocks.39.ffn.net.2.bias"),
    # quantization tensors follow their Linear
    ("blocks.3.self_attn.q.weight_scale", "blocks.3.attn1.to_q.weight_scale"),
    ("blocks.3.ffn.2.weight_dual_scale", "blocks.3.ffn.net.2.weight_dual_scale"),
    ("blocks.3.cross_attn.o.mul_scale", "blocks.3.attn2.to_out.0.mul_scale"),
]


@pytest.mark.parametrize(("original", "diffusers"), GOLDEN)
def test_golden_pairs_map_both_ways(original, diffusers):
    assert wan_to_diffusers(original).name == diffusers
    assert diffusers_to_wan(diffusers) == original


@pytest.mark.parametrize(
    "name",
    [
        "blocks.0.self_attn.qkv.weight",  # not a Wan module
        "blocks.0.self_attn.q.weight_offset",  # not a tensor of an MXFP4 Linear
        "blocks.0.norm3.weight_scale",  # quantization tensors only on Linears
        "blocks.01.ffn.0.weight",  # block index with a leading zero
        "blocks.x.ffn.0.weight",
        "block.0.ffn.0.weight",
        "ffn.0.weight",  # block module outside a block
        "blocks.0.head.head.weight",  # root module inside a block
        "head.head",  # a module, not a tensor
        "modulation",
        "blocks.0.self_attn.q.linear.weight",  # Smooth wrapper must be stripped first
        "model.blocks.0.ffn.0.weight",
        "blocks.0.attn1.to_q.weight",  # a diffusers name is not an original name
    ],
)
def test_unknown_original_names_are_errors(name):
    with pytest.raises(CheckpointError, match="not in the exact Wan2.2 name table"):
        wan_to_diffusers(name)


@pytest.mark.parametrize(
    "name", ["blocks.0.self_attn.q.weight", "blocks.0.attn1.to_qkv.weight", "transformer.proj_out.weight"]
)
def test_unknown_diffusers_names_are_errors(name):
    with pytest.raises(CheckpointError):
        diffusers_to_wan(name)


def test_parse_diffusers_places_tensors():
    p = parse_diffusers("blocks.4.attn1.to_out.0.weight_scale")
    assert (p.layer, p.leaf, p.kind, p.block) == ("blocks.4.attn1.to_out.0", "weight_scale", "linear", 4)
    p = parse_diffusers("blocks.4.scale_shift_table")
    assert (p.layer, p.leaf, p.kind, p.block) == (None, "blocks.4.scale_shift_table", "param", 4)
    p = parse_diffusers("blocks.4.norm2.bias")
    assert (p.layer, p.kind) == ("blocks.4.norm2", "norm")
    assert parse_diffusers("patch_embedding.weight").kind == "conv"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("blocks.1.self_attn.q.linear.weight", ("blocks.1.self_attn.q.weight", True)),
        ("blocks.1.self_attn.q.linear.weight_scale", ("blocks.1.self_attn.q.weight_scale", True)),
        ("blocks.1.ffn.2.linear.weight_dual_scale", ("blocks.1.ffn.2.weight_dual_scale", True)),
        ("blocks.1.ffn.2.linear.bias", ("blocks.1.ffn.2.bias", True)),
        ("blocks.1.ffn.2.div.mul_scale", ("blocks.1.ffn.2.mul_scale", True)),
        ("blocks.1.ffn.2.weight", ("blocks.1.ffn.2.weight", False)),
        ("blocks.1.ffn.2.linear.weight_offset", ("blocks.1.ffn.2.linear.weight_offset", False)),
        ("blocks.1.ffn.2.div.scale", ("blocks.1.ffn.2.div.scale", False)),
    ],
)
def test_strip_smooth_wrapper(name, expected):
    assert strip_smooth_wrapper(name) == expected


RUNTIME = [
    ("blocks.5.attn1.to_q", "blocks.5.attn1.to_qkv"),
    ("blocks.5.attn1.to_k", "blocks.5.attn1.to_qkv"),
    ("blocks.5.attn1.to_v", "blocks.5.attn1.to_qkv"),
    ("blocks.5.attn1.to_out.0", "blocks.5.attn1.to_out"),
    ("blocks.5.attn2.to_q", "blocks.5.attn2.to_q"),
    ("blocks.5.attn2.to_k", "blocks.5.attn2.to_k"),
    ("blocks.5.attn2.to_v", "blocks.5.attn2.to_v"),
    ("blocks.5.attn2.to_out.0", "blocks.5.attn2.to_out"),
    ("blocks.5.attn2.add_k_proj", "blocks.5.attn2.add_k_proj"),
    ("blocks.5.attn2.add_v_proj", "blocks.5.attn2.add_v_proj"),
    ("blocks.5.ffn.net.0.proj", "blocks.5.ffn.net_0.proj"),
    ("blocks.5.ffn.net.2", "blocks.5.ffn.net_2"),
    ("proj_out", "proj_out"),
    ("condition_embedder.time_proj", "condition_embedder.time_proj"),
    ("condition_embedder.text_embedder.linear_1", "condition_embedder.text_embedder.linear_1"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "condition_embedder.image_embedder.ff.net.0.proj"),
]


@pytest.mark.parametrize(("layer", "runtime"), RUNTIME)
def test_runtime_names(layer, runtime):
    assert runtime_layer_name(layer) == runtime


@pytest.mark.parametrize("layer", ["blocks.5.norm2", "blocks.5.attn1.norm_q", "patch_embedding", "blocks.5"])
def test_runtime_name_of_a_non_linear_is_an_error(layer):
    with pytest.raises(CheckpointError):
        runtime_layer_name(layer)


def test_natural_order():
    names = ["blocks.10.ffn.net_2", "blocks.2.attn1.to_qkv", "proj_out", "blocks.2.attn1.to_out"]
    assert sorted(names, key=layer_order) == [
        "blocks.2.attn1.to_out",
        "blocks.2.attn1.to_qkv",
        "blocks.10.ffn.net_2",
        "proj_out",
    ]


def test_every_diffusers_wan_tensor_round_trips():
    """All tensors of diffusers' own WanTransformer3DModel (with the I2V image embedder) are in the table."""
    diffusers = pytest.importorskip("diffusers")
    from vllm_omni_mxfp4_tiny import tiny_transformer_config

    config = tiny_transformer_config(image_dim=8, added_kv_proj_dim=512, pos_embed_seq_len=4)
    model = diffusers.WanTransformer3DModel(**config)
    names = list(model.state_dict())
    assert len(names) > 40
    for name in names:
        assert wan_to_diffusers(diffusers_to_wan(name)).name == name
    linears = {n for n, m in model.named_modules() if type(m).__name__ == "Linear"}
    assert linears == {parse_diffusers(n).layer for n in names if parse_diffusers(n).kind == "linear"}
