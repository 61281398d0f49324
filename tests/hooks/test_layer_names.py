"""Names in a config against the model vLLM-Omni builds: layer lists, experts, the leading-block count.

Each bad config is a valid one with one name changed; the real tiny Wan2.2 transformer (2 blocks) is
built by vLLM-Omni's ``create_transformer_from_config`` with the config made by vLLM-Omni's own
factory, as the engine does.
"""

from __future__ import annotations

import pytest

from tests.support.layers import build_expert, checkpoint_variant, offline_dirs, quantized_layers

__all__ = ["offline_dirs"]

pytestmark = pytest.mark.omni


def _refused(env, model_dir, spec, sub="transformer") -> str:
    with pytest.raises(ValueError) as info:
        build_expert(env, model_dir, spec, sub)
    return str(info.value)


def test_the_valid_lists_build_and_route_as_listed(vllm_env, tiny_dir):
    spec = {
        "method": "mxfp4",
        "ignored_layers": ["blocks.1.ffn.net_2"],
        "w4a8_fallback_layers": ["blocks.0.attn1.to_qkv"],
    }
    layers = quantized_layers(build_expert(vllm_env, tiny_dir, spec))
    assert "blocks.1.ffn.net_2" not in layers and len(layers) == 15
    assert layers["blocks.0.attn1.to_qkv"].quant_method.is_w4a8_fallback_layer
    # The paths a config lists are the prefixes get_quant_method saw: the module names.
    assert all(layer.quant_method.prefix == name for name, layer in layers.items())


@pytest.mark.parametrize(
    ("method", "key", "typo", "meant"),
    [
        ("mxfp4", "ignored_layers", "blocks.1.ffn.net2", "blocks.1.ffn.net_2"),
        ("mxfp4", "ignored_layers", "blocks.2.ffn.net_2", "blocks.1.ffn.net_2"),
        ("mxfp4", "ignored_layers", "blocks.0.attn1.to_kqv", "blocks.0.attn1.to_qkv"),
        ("mxfp4", "ignored_layers", "blocks.0.norm2", None),
        ("mxfp4_dualscale", "ignored_layers", "blocks.1.attn2.to_ou", "blocks.1.attn2.to_out"),
    ],
)
def test_a_layer_entry_that_names_no_linear_is_refused(vllm_env, tiny_dir, method, key, typo, meant):
    valid = {"method": method, key: ["blocks.0.ffn.net_0.proj"]}
    if method == "mxfp4_dualscale":
        valid["num_bf16_fallback_layers"] = 0
    build_expert(vllm_env, tiny_dir, valid)
    message = _refused(vllm_env, tiny_dir, {**valid, key: ["blocks.0.ffn.net_0.proj", typo]})
    assert f"{key} entry {typo!r} matches no Linear of the WanTransformer3DModel" in message
    # 16 vLLM Linears and 6 plain nn.Linear (embedders, proj_out); the sample lists block 0's paths.
    assert "(22 Linears)" in message and "blocks.0.attn1.to_qkv" in message
    if meant is None:
        assert "Did you mean" not in message
    else:
        assert f"Did you mean {meant!r}?" in message


@pytest.mark.parametrize("typo", ["blocks.0.attn1.to_kqv", "blocks.0.norm2"])
def test_vllm_omnis_own_wan_check_names_a_w4a8_entry_first(vllm_env, tiny_dir, typo):
    """vLLM-Omni's Wan2.2 transformer checks ``w4a8_fallback_layers`` itself in its constructor, before
    the build hook's check of every list: its message is the one a user sees for this key."""
    valid = {"method": "mxfp4", "w4a8_fallback_layers": ["blocks.0.ffn.net_0.proj"]}
    build_expert(vllm_env, tiny_dir, valid)
    message = _refused(
        vllm_env, tiny_dir, {**valid, "w4a8_fallback_layers": ["blocks.0.ffn.net_0.proj", typo]}
    )
    assert "w4a8_fallback_layers requires exact runtime Linear paths" in message and typo in message


def test_a_plain_linear_may_be_listed_as_ignored(vllm_env, tiny_dir):
    """Wan's condition embedders and proj_out are plain nn.Linear in vLLM-Omni: BF16 whatever the
    config says, so the merge's ignored_layers (which lists them) is valid, not a typo."""
    spec = {"method": "mxfp4", "ignored_layers": ["condition_embedder.text_embedder.linear_1", "proj_out"]}
    assert len(quantized_layers(build_expert(vllm_env, tiny_dir, spec))) == 16


def test_an_offline_checkpoints_ignored_layers_are_checked_too(vllm_env, offline_dirs, tmp_path):
    def typo(config):
        config["quantization_config"]["ignored_layers"] = ["blocks.0.ffn.net_0.prj"]

    build_expert(vllm_env, offline_dirs["mxfp4"], None)
    model = checkpoint_variant(offline_dirs["mxfp4"], tmp_path / "model", config=typo)
    message = _refused(vllm_env, model, None)
    assert "ignored_layers entry 'blocks.0.ffn.net_0.prj'" in message
    assert "Did you mean 'blocks.0.ffn.net_0.proj'?" in message


def test_num_bf16_fallback_layers_larger_than_the_block_count_is_refused(vllm_env, tiny_dir):
    layers = quantized_layers(
        build_expert(vllm_env, tiny_dir, {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 1})
    )
    assert layers and all(name.startswith("blocks.1.") for name in layers)
    build_expert(vllm_env, tiny_dir, {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 2})
    message = _refused(vllm_env, tiny_dir, {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 3})
    assert "num_bf16_fallback_layers=3 is larger than the 2 blocks" in message
    assert "Set it to at most 2" in message
    message = _refused(vllm_env, tiny_dir, "mxfp4_dualscale")  # the default, 5
    assert "num_bf16_fallback_layers=5 is larger than the 2 blocks" in message


@pytest.mark.parametrize(
    "spec",
    [
        {"transfomer": "mxfp4", "transformer_2": "mxfp4"},
        {"transfomer": {"method": "mxfp4"}, "transformer_2": None},
        {"transfomer": "mxfp4_dualscale"},
    ],
)
def test_a_per_component_key_that_names_no_expert_is_refused(vllm_env, tiny_dir, spec):
    valid = {("transformer" if k == "transfomer" else k): v for k, v in spec.items()}
    for sub in ("transformer", "transformer_2"):
        if valid.get(sub, valid.get("default")) != "mxfp4_dualscale":
            build_expert(vllm_env, tiny_dir, valid, sub)
    for sub in ("transformer", "transformer_2"):
        message = _refused(vllm_env, tiny_dir, spec, sub)
        assert "Unknown component 'transfomer' in the per-component config." in message
        assert "Did you mean 'transformer'?" in message
        assert "Known components: transformer, transformer_2." in message


def test_the_user_guides_per_component_forms_build_through_vllm_omnis_factory(vllm_env, tiny_dir):
    spec = {
        "transformer": "mxfp4",
        "transformer_2": {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0},
    }
    by_expert = {
        sub: {
            m.quant_method.method_name
            for m in quantized_layers(build_expert(vllm_env, tiny_dir, spec, sub)).values()
        }
        for sub in ("transformer", "transformer_2")
    }
    assert by_expert == {"transformer": {"mxfp4"}, "transformer_2": {"mxfp4_dualscale"}}
    for spec in ({"default": "mxfp4"}, {"transformer": "mxfp4", "transformer_2": "mxfp4"}):
        for sub in ("transformer", "transformer_2"):
            layers = quantized_layers(build_expert(vllm_env, tiny_dir, spec, sub))
            assert len(layers) == 16 and {m.quant_method.method_name for m in layers.values()} == {"mxfp4"}


def test_the_vace_pipeline_checks_component_keys_too(vllm_env):
    from vllm_omni.diffusion.models.wan2_2 import pipeline_wan2_2_vace
    from vllm_omni.quantization import build_quant_config

    resolve = pipeline_wan2_2_vace.resolve_wan_transformer_quant_config
    assert resolve({}, build_quant_config({"transformer": "mxfp4"}), "transformer").get_name() == "mxfp4"
    with pytest.raises(ValueError, match="Unknown component 'transformer_3' .*Did you mean 'transformer_2'"):
        resolve({}, build_quant_config({"transformer_3": "mxfp4"}), "transformer")


def _build_vace(env, model_dir, spec):
    from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2 import load_transformer_config
    from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2_vace import create_vace_transformer_from_config
    from vllm_omni.quantization import build_quant_config

    from vllm_omni_mxfp4.hooks.names import check_built_model

    config = {**load_transformer_config(str(model_dir), "transformer"), "vace_layers": [0]}
    with env.context():
        model = create_vace_transformer_from_config(config, build_quant_config(spec))
    check_built_model(model, "transformer")  # as the build hook checks the pipeline's transformer
    return model


def test_the_vace_transformers_own_blocks_are_checked_too(vllm_env, tiny_dir):
    """VACE builds its vace_blocks after the Wan constructor's own check: entries naming them are
    valid, and a typo in one is refused by the check of the built model."""
    valid = {"method": "mxfp4", "ignored_layers": ["vace_blocks.0.attn1.to_qkv", "blocks.1.ffn.net_2"]}
    model = _build_vace(vllm_env, tiny_dir, valid)
    assert "vace_blocks.0.attn1.to_qkv" in dict(model.named_modules())
    typo = {**valid, "ignored_layers": ["vace_blocks.0.attn1.to_qvk"]}
    with pytest.raises(ValueError, match="'vace_blocks.0.attn1.to_qvk' matches no Linear.*Did you mean"):
        _build_vace(vllm_env, tiny_dir, typo)
