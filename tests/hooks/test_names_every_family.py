"""A layer name that matches nothing is refused where vLLM-Omni builds the pipeline, for every family
that runs end to end: the engine's own ``initialize_model`` builds each tiny pipeline with a valid
config (which builds) and with the same config and one name misspelt (which is refused, naming the
entry, the transformer and the closest Linear), before any weight is read."""

from __future__ import annotations

import importlib

import pytest

from tests.support.layers import initialize_pipeline

pytestmark = pytest.mark.omni

#: Each family's tiny pipeline builder (vllm_omni_mxfp4_tiny) and the transformer class it builds.
FAMILIES = {
    "wan2_2": ("vllm_omni_mxfp4_tiny.wan", "build_tiny_wan", "WanTransformer3DModel"),
    "qwen_image": (
        "vllm_omni_mxfp4_tiny.qwen_image",
        "build_tiny_qwen_image",
        "QwenImageTransformer2DModel",
    ),
    "flux1": ("vllm_omni_mxfp4_tiny.flux", "build_tiny_flux", "FluxTransformer2DModel"),
    "flux2_klein": (
        "vllm_omni_mxfp4_tiny.flux2_klein",
        "build_tiny_flux2_klein",
        "Flux2Transformer2DModel",
    ),
    "hunyuan_video_15": (
        "vllm_omni_mxfp4_tiny.hunyuan_video",
        "build_tiny_hunyuan_video",
        "HunyuanVideo15Transformer3DModel",
    ),
    "z_image": ("vllm_omni_mxfp4_tiny.z_image", "build_tiny_z_image", "ZImageTransformer2DModel"),
}


def _quantized_prefixes(pipeline) -> list[str]:
    """The prefixes the transformer's Linears handed our config (what ``ignored_layers`` names)."""
    from vllm_omni_mxfp4.omni.linear import MxLinearMethod

    return sorted(
        m.quant_method.prefix
        for m in pipeline.transformer.modules()
        if isinstance(getattr(m, "quant_method", None), MxLinearMethod)
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_misspelt_ignored_layer_stops_the_build_of_every_family(vllm_env, family):
    module, builder, transformer = FAMILIES[family]
    if family == "z_image":
        importlib.import_module("vllm_omni_mxfp4_tiny.z_image_config").install()
    model_dir = getattr(importlib.import_module(module), builder)()
    prefixes = _quantized_prefixes(initialize_pipeline(vllm_env, model_dir, {"method": "mxfp4"}))
    assert prefixes, f"{family}: nothing quantized"
    listed = prefixes[-1]
    kept = initialize_pipeline(vllm_env, model_dir, {"method": "mxfp4", "ignored_layers": [listed]})
    assert listed not in _quantized_prefixes(kept)
    typo = listed[:-1] + ("x" if listed[-1] != "x" else "y")
    with pytest.raises(ValueError) as refused:
        initialize_pipeline(vllm_env, model_dir, {"method": "mxfp4", "ignored_layers": [typo]})
    message = str(refused.value)
    assert f"ignored_layers entry {typo!r} matches no Linear of the {transformer} (transformer)" in message
    assert f"Did you mean {listed!r}?" in message
