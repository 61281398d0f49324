"""The pure name checks (``config/names.py``) on the Linear paths of a 2-block Wan2.2 transformer."""

from __future__ import annotations

import pytest

from vllm_omni_mxfp4.config import (
    Mxfp4Config,
    Mxfp4DualScaleConfig,
    check_component_names,
    check_model_names,
)
from vllm_omni_mxfp4.config.names import layer_lists

PER_BLOCK = ("attn1.to_qkv", "attn1.to_out", "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out")
LINEARS = {f"blocks.{b}.{p}" for b in range(2) for p in (*PER_BLOCK, "ffn.net_0.proj", "ffn.net_2")}


def test_every_layer_list_of_both_methods_is_checked():
    lists = {"ignored_layers", "mxfp8_layers", "svd_lowrank_layers"}
    assert set(layer_lists(Mxfp4Config())) == {*lists, "w4a8_fallback_layers"}
    assert set(layer_lists(Mxfp4DualScaleConfig())) == lists


def test_a_low_rank_entry_must_name_a_quantized_linear():
    """A checkpoint's svd_lowrank_layers entry matching no Linear would be ignored silently (its layer
    loads no pair); one naming a plain Linear could not load its pair."""
    ranks = {"blocks.1.ffn.net_2": 16}
    check_model_names(Mxfp4Config(is_checkpoint_mxfp4_serialized=True, svd_lowrank_layers=ranks), LINEARS, 2)
    typo = Mxfp4Config(is_checkpoint_mxfp4_serialized=True, svd_lowrank_layers={"blocks.1.ffn.net2": 16})
    with pytest.raises(
        ValueError, match=r"svd_lowrank_layers entry 'blocks\.1\.ffn\.net2' matches no Linear"
    ):
        check_model_names(typo, LINEARS, 2)
    plain = Mxfp4Config(is_checkpoint_mxfp4_serialized=True, svd_lowrank_layers={"proj_out": 16})
    with pytest.raises(ValueError, match=r"svd_lowrank_layers entry 'proj_out' is a plain torch\.nn\.Linear"):
        check_model_names(plain, {*LINEARS, "proj_out"}, 2, plain={"proj_out"})


@pytest.mark.parametrize("key", ["ignored_layers", "w4a8_fallback_layers"])
def test_an_entry_outside_the_model_is_refused_with_the_closest_path(key):
    valid = Mxfp4Config(**{key: ("blocks.1.attn2.to_out",)})
    check_model_names(valid, LINEARS, 2)
    bad = Mxfp4Config(**{key: ("blocks.1.attn2.to_out", "blocks.1.atn2.to_out")})
    with pytest.raises(ValueError) as info:
        check_model_names(bad, LINEARS, 2, model="transformer_2")
    message = str(info.value)
    assert f"{key} entry 'blocks.1.atn2.to_out' matches no Linear of transformer_2 (16 Linears)" in message
    assert "Did you mean 'blocks.1.attn2.to_out'?" in message
    assert "e.g. blocks.0.attn1.to_out, blocks.0.attn1.to_qkv" in message  # block 0's paths, in order


def test_entries_of_another_pipeline_rank_are_left_to_it():
    config = Mxfp4Config(ignored_layers=("blocks.3.ffn.net_2",))
    check_model_names(config, LINEARS, 4, unverifiable=["blocks.2", "blocks.3"])
    with pytest.raises(ValueError, match="'blocks.3.ffn.net_2' matches no Linear"):
        check_model_names(config, LINEARS, 4, unverifiable=["blocks.2", "blocks.30"])


def test_the_leading_block_count_must_fit_the_model():
    check_model_names(Mxfp4DualScaleConfig(num_bf16_fallback_layers=2), LINEARS, 2)
    with pytest.raises(ValueError) as info:
        check_model_names(Mxfp4DualScaleConfig(num_bf16_fallback_layers=3), LINEARS, 2, model="transformer")
    assert "num_bf16_fallback_layers=3 is larger than the 2 blocks of transformer" in str(info.value)
    # Offline checkpoints do not use it; an unknown block count is not checked.
    check_model_names(
        Mxfp4DualScaleConfig(is_checkpoint_serialized=True, num_bf16_fallback_layers=9), LINEARS, 2
    )
    check_model_names(Mxfp4DualScaleConfig(num_bf16_fallback_layers=9), LINEARS, None)


def test_component_keys_must_name_a_known_component():
    check_component_names(["transformer", "default"], ["transformer", "transformer_2"])
    with pytest.raises(ValueError) as info:
        check_component_names(["transformer", "transformer2"], ["transformer", "transformer_2"], " in X")
    message = str(info.value)
    assert "Unknown component 'transformer2' in X. Did you mean 'transformer_2'?" in message
    assert "Known components: transformer, transformer_2." in message
