"""Layer routing: BF16 > W4A8 (layer OR step) > W4A4, the DualScale leading-block rule, step lookup."""

from __future__ import annotations

import pytest

from vllm_omni_mxfp4.config import LayerRoute, Mxfp4Config, Mxfp4DualScaleConfig, Precision
from vllm_omni_mxfp4.steps import denoise_step

BF16, W4A8, W4A4 = Precision.BF16, Precision.W4A8, Precision.W4A4

POLICY = Mxfp4Config(
    ignored_layers=["blocks.0.attn1.to_qkv", "blocks.2.ffn.net_2"],
    w4a8_fallback_layers=["blocks.1.attn1.to_qkv", "blocks.2.ffn.net_2"],
    w4a8_fallback_steps=[0, 3],
)

# (prefix, static precision, {step: precision})
PRECEDENCE = [
    # listed in ignored_layers: BF16 on every step
    ("blocks.0.attn1.to_qkv", BF16, {0: BF16, 1: BF16, 3: BF16}),
    # listed in both ignored_layers and w4a8_fallback_layers: BF16 wins
    ("blocks.2.ffn.net_2", BF16, {0: BF16, 1: BF16, 3: BF16}),
    # listed in w4a8_fallback_layers: W4A8 on every step
    ("blocks.1.attn1.to_qkv", W4A8, {0: W4A8, 1: W4A8, 2: W4A8, 3: W4A8, 4: W4A8}),
    # not listed: W4A8 on listed steps only (layer OR step)
    ("blocks.1.ffn.net_2", W4A4, {0: W4A8, 1: W4A4, 2: W4A4, 3: W4A8, 4: W4A4, 1000: W4A4}),
    ("blocks.1.attn2.to_q", W4A4, {0: W4A8, 1: W4A4}),
    ("blocks.1.ffn.net_0.proj", W4A4, {3: W4A8, 2: W4A4}),
    ("blocks.1.attn1.to_out", W4A4, {3: W4A8, 5: W4A4}),
    # outside blocks.N.: quantized unless listed
    ("proj_out", W4A4, {0: W4A8, 1: W4A4}),
    ("condition_embedder.time_embedder.linear_1", W4A4, {0: W4A8, 1: W4A4}),
]


@pytest.mark.parametrize("prefix,static,by_step", PRECEDENCE)
def test_mxfp4_precedence(prefix, static, by_step):
    route = POLICY.route(prefix)
    assert route.precision is static
    assert route.prefix == prefix
    for step, expected in by_step.items():
        assert route.precision_at(step) is expected, (prefix, step)


def test_layer_and_step_union_over_a_request():
    """Per step, a layer listed by name and one selected only by step: the A8/A4 sequence."""
    config = Mxfp4Config(w4a8_fallback_layers=["blocks.3.ffn.net_2"], w4a8_fallback_steps=[1])
    listed, other = config.route("blocks.3.ffn.net_2"), config.route("blocks.4.ffn.net_2")
    sequence = [r.precision_at(step) for step in range(3) for r in (listed, other)]
    assert sequence == [W4A8, W4A4, W4A8, W4A8, W4A8, W4A4]


def test_no_fallback_is_plain_w4a4_and_needs_no_step():
    route = Mxfp4Config().route("blocks.0.attn1.to_qkv")
    assert route == LayerRoute(W4A4, (), "W4A4", "blocks.0.attn1.to_qkv")
    assert route.precision_at(None) is W4A4
    assert route.precision_now() is W4A4


def test_step_fallback_without_a_step_is_an_error():
    route = POLICY.route("blocks.5.ffn.net_2")
    assert route.a8_steps == (0, 3)
    with pytest.raises(RuntimeError) as info:
        route.precision_at(None)
    message = str(info.value)
    assert "'blocks.5.ffn.net_2'" in message
    assert "[0, 3]" in message
    assert "no denoise step is published" in message
    assert "denoise_step_idx" in message
    with pytest.raises(RuntimeError, match="no denoise step is published"):
        route.precision_now()


@pytest.mark.parametrize("prefix", ["blocks.1.attn1.to_qkv", "blocks.0.attn1.to_qkv"])
def test_layer_only_and_bf16_layers_need_no_step(prefix):
    route = POLICY.route(prefix)
    assert route.a8_steps == ()
    assert route.precision_at(None) is route.precision
    assert route.precision_now() is route.precision


@pytest.mark.parametrize("step", [True, 1.0, "1"])
def test_precision_at_rejects_non_integer_steps(step):
    with pytest.raises(TypeError, match="denoise step must be an integer"):
        POLICY.route("blocks.5.ffn.net_2").precision_at(step)


def test_precision_now_reads_the_published_step():
    route = POLICY.route("blocks.5.ffn.net_2")
    with denoise_step(3):
        assert route.precision_now() is W4A8
    with denoise_step(2):
        assert route.precision_now() is W4A4


def test_route_reasons():
    assert POLICY.route("blocks.0.attn1.to_qkv").reason == "listed in ignored_layers"
    assert POLICY.route("blocks.1.attn1.to_qkv").reason == "listed in w4a8_fallback_layers"
    assert POLICY.route("blocks.5.ffn.net_2").reason == "W4A4; W4A8 on denoise steps [0, 3]"


def test_matching_is_exact():
    config = Mxfp4Config(
        ignored_layers=["blocks.1.attn1.to_qkv"], w4a8_fallback_layers=["blocks.1.ffn.net_2"]
    )
    assert config.route("blocks.11.attn1.to_qkv").precision is W4A4
    assert config.route("blocks.1.attn1").precision is W4A4
    assert config.route("blocks.1.ffn.net_2.proj").precision is W4A4
    assert config.route("blocks.1.ffn.net_2").precision is W4A8


def test_route_needs_a_string():
    with pytest.raises(TypeError, match="prefix must be a string"):
        POLICY.route(None)


# --------------------------------------------------------------------------------------------------
# DualScale
# --------------------------------------------------------------------------------------------------

# (config, prefix, expected precision)
DUALSCALE = [
    (Mxfp4DualScaleConfig(), "blocks.0.attn1.to_qkv", BF16),
    (Mxfp4DualScaleConfig(), "blocks.4.ffn.net_2", BF16),
    (Mxfp4DualScaleConfig(), "blocks.5.ffn.net_2", W4A4),
    (Mxfp4DualScaleConfig(), "blocks.39.attn2.to_v", W4A4),
    (Mxfp4DualScaleConfig(), "proj_out", W4A4),
    (Mxfp4DualScaleConfig(), "condition_embedder.text_embedder.linear_1", W4A4),
    (Mxfp4DualScaleConfig(), "transformer_blocks.0.ff", W4A4),
    (Mxfp4DualScaleConfig(), "blocks.x.ffn", W4A4),
    (Mxfp4DualScaleConfig(num_bf16_fallback_layers=0), "blocks.0.attn1.to_qkv", W4A4),
    (Mxfp4DualScaleConfig(num_bf16_fallback_layers=12), "blocks.11.ffn.net_2", BF16),
    (Mxfp4DualScaleConfig(num_bf16_fallback_layers=12), "blocks.12.ffn.net_2", W4A4),
    (Mxfp4DualScaleConfig(ignored_layers=["blocks.10.attn1.to_qkv"]), "blocks.10.attn1.to_qkv", BF16),
    (Mxfp4DualScaleConfig(ignored_layers=["proj_out"]), "proj_out", BF16),
    # offline: the leading-block rule does not apply, ignored_layers does
    (Mxfp4DualScaleConfig(is_checkpoint_serialized=True), "blocks.0.attn1.to_qkv", W4A4),
    (Mxfp4DualScaleConfig(is_checkpoint_serialized=True, num_bf16_fallback_layers=40), "blocks.3.ffn.net_2", W4A4),
    (Mxfp4DualScaleConfig(is_checkpoint_serialized=True, ignored_layers=["blocks.7.attn1.to_out"]),
     "blocks.7.attn1.to_out", BF16),
]  # fmt: skip


@pytest.mark.parametrize("config,prefix,expected", DUALSCALE)
def test_dualscale_routing(config, prefix, expected):
    route = config.route(prefix)
    assert route.precision is expected
    assert route.a8_steps == ()
    assert route.precision_at(None) is expected


def test_dualscale_reasons():
    config = Mxfp4DualScaleConfig(ignored_layers=["blocks.1.ffn.net_2"])
    assert config.route("blocks.1.ffn.net_2").reason == "listed in ignored_layers"
    assert "num_bf16_fallback_layers" in config.route("blocks.2.ffn.net_2").reason
