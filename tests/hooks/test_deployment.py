"""Deployment features refused with our methods (hooks/deployment.py), where vLLM-Omni builds the
pipeline: the message names the flag, the methods and what to use instead; the same feature on a
BF16 pipeline, and the supported alternatives, build as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.layers import initialize_pipeline

DOC = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"

pytestmark = pytest.mark.omni

FEATURES = {
    "hsdp": {"parallel_config": {"use_hsdp": True, "hsdp_shard_size": 2}},
    "distill": {"lora_backend": "distill", "lora_path": "/adapters/style"},
    "tea_cache": {"cache_backend": "tea_cache"},
    "mag_cache": {"cache_backend": "mag_cache"},
}
MESSAGES = {  # flag, then what to use instead
    "hsdp": ("--use-hsdp (use_hsdp) = on", "--ulysses-degree"),
    "distill": ("--lora-backend distill (lora_backend='distill') = distill", "--lora-backend peft"),
    "tea_cache": ("--cache-backend (cache_backend) = tea_cache", "--cache-backend cache_dit"),
    "mag_cache": ("--cache-backend (cache_backend) = mag_cache", "--cache-backend cache_dit"),
}
SPECS = {
    "mxfp4": {"method": "mxfp4"},
    "per-expert": {
        "transformer": {"method": "mxfp4"},
        "transformer_2": {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0},
    },
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("spec", list(SPECS))
def test_refused_with_the_flag_the_methods_and_the_alternative(vllm_env, tiny_dir, feature, spec):
    with pytest.raises(ValueError) as refused:
        initialize_pipeline(vllm_env, tiny_dir, SPECS[spec], **FEATURES[feature])
    flag, instead = MESSAGES[feature]
    text = str(refused.value)
    methods = "mxfp4" if spec == "mxfp4" else "mxfp4, mxfp4_dualscale"
    assert text.startswith(f"{flag} is not supported with {methods} (Wan22Pipeline"), text
    assert f"Instead, use {instead}" in text or f"Instead, split the work with {instead}" in text, text
    if spec == "mxfp4" and feature != "mag_cache":  # docs/deployment.md quotes these three in full
        assert " ".join(text.split()) in " ".join(DOC.read_text().split()), "docs/deployment.md quotes it"


@pytest.mark.parametrize("feature", list(FEATURES))
def test_a_bf16_pipeline_is_not_refused(vllm_env, tiny_dir, feature):
    pipeline = initialize_pipeline(vllm_env, tiny_dir, None, **FEATURES[feature])
    assert type(pipeline).__name__ == "Wan22Pipeline"


@pytest.mark.parametrize(
    "supported",
    [{"cache_backend": "cache_dit"}, {"lora_backend": "peft", "lora_path": "/adapters/style"}, {}],
    ids=["cache_dit", "peft", "plain"],
)
def test_the_supported_alternatives_build(vllm_env, tiny_dir, supported):
    from vllm_omni_mxfp4.hooks.deployment import quantized_methods

    pipeline = initialize_pipeline(vllm_env, tiny_dir, SPECS["per-expert"], **supported)
    assert quantized_methods(pipeline) == ["mxfp4", "mxfp4_dualscale"]
