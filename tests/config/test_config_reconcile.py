"""Reconciling a runtime config with a checkpoint's quantization_config, and per-expert resolution."""

from __future__ import annotations

import logging
import re

import pytest

from vllm_omni_mxfp4.config import (
    ComponentConfigs,
    Mxfp4Config,
    Mxfp4DualScaleConfig,
    parse_quantization,
    reconcile_with_checkpoint,
    resolve_component,
)

MISMATCH_TAIL = "Pass a matching --quantization flag or omit it for auto-detection."
DISABLED_MSG = (
    "Quantization is disabled for component 'transformer_2', but its checkpoint declares quantization. "
    "Use a BF16 checkpoint for this component or enable its matching quantization method."
)

SERIALIZED_MXFP4 = {
    "quant_method": "mxfp4",
    "is_checkpoint_mxfp4_serialized": True,
    "ignored_layers": ["blocks.0.attn1.to_qkv", "proj_out"],
}
SERIALIZED_DUAL = {
    "quant_method": "mxfp4_dualscale",
    "is_checkpoint_serialized": True,
    "ignored_layers": ["blocks.0.attn1.to_qkv", "blocks.0.attn1.to_out", "proj_out"],
}
RUNTIME = Mxfp4Config(
    ignored_layers=["blocks.3.ffn.net_2"],
    w4a8_fallback_layers=["blocks.10.attn1.to_qkv"],
    w4a8_fallback_steps=[0, 39],
    mxfp4_scale_alg=2,
    backend="emulated",
)

# --------------------------------------------------------------------------------------------------
# No checkpoint config
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", [None, {}])
@pytest.mark.parametrize("runtime", [None, RUNTIME, Mxfp4DualScaleConfig()])
def test_without_a_checkpoint_config_the_runtime_config_stands(runtime, checkpoint):
    assert reconcile_with_checkpoint(runtime, checkpoint) is runtime


# --------------------------------------------------------------------------------------------------
# Auto-detection
# --------------------------------------------------------------------------------------------------


def test_auto_detects_a_serialized_dualscale_checkpoint(caplog):
    with caplog.at_level(logging.INFO, logger="vllm_omni_mxfp4.config"):
        config = reconcile_with_checkpoint(None, SERIALIZED_DUAL)
    assert config == Mxfp4DualScaleConfig(
        is_checkpoint_serialized=True,
        ignored_layers=("blocks.0.attn1.to_out", "blocks.0.attn1.to_qkv", "proj_out"),
    )
    assert "Auto-detected mxfp4_dualscale quantization" in caplog.text


def test_auto_detection_uses_the_saved_policies():
    saved = {
        **SERIALIZED_MXFP4,
        "w4a8_fallback_steps": [1, 0],
        "mxfp4_scale_alg": 2,
        "require_smooth_scale": True,
    }
    config = reconcile_with_checkpoint(None, saved)
    assert config.w4a8_fallback_steps == (0, 1)
    assert config.mxfp4_scale_alg == 2
    assert config.require_smooth_scale is True
    assert config.ignored_layers == ("blocks.0.attn1.to_qkv", "proj_out")


@pytest.mark.parametrize(
    "checkpoint,expected",
    [
        ("mxfp4", Mxfp4Config()),
        ({"quant_method": "mxfp4"}, Mxfp4Config()),
        ({"method": "mxfp4_dualscale"}, Mxfp4DualScaleConfig()),
        (
            {"quant_method": "mxfp4", "modules_to_not_convert": ["proj_out"]},
            Mxfp4Config(ignored_layers=["proj_out"]),
        ),
    ],
)
def test_auto_detects_method_only_and_online_checkpoints(checkpoint, expected):
    assert reconcile_with_checkpoint(None, checkpoint) == expected


@pytest.mark.parametrize("checkpoint", ["fp8", {"quant_method": "fp8", "activation_scheme": "dynamic"}])
def test_auto_detection_of_a_method_this_package_does_not_own(checkpoint):
    with pytest.raises(
        ValueError, match="Unknown quantization method 'fp8'.*Supported: mxfp4, mxfp4_dualscale"
    ):
        reconcile_with_checkpoint(None, checkpoint)


# --------------------------------------------------------------------------------------------------
# Method mismatch
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "runtime,checkpoint,declared,active",
    [
        (Mxfp4Config(), "mxfp4_dualscale", "mxfp4_dualscale", "mxfp4"),
        (Mxfp4Config(), SERIALIZED_DUAL, "mxfp4_dualscale", "mxfp4"),
        (Mxfp4DualScaleConfig(), SERIALIZED_MXFP4, "mxfp4", "mxfp4_dualscale"),
        (Mxfp4DualScaleConfig(), {"quant_method": "mxfp4"}, "mxfp4", "mxfp4_dualscale"),
        (Mxfp4Config(), {"quant_method": "fp8"}, "fp8", "mxfp4"),
    ],
)
def test_method_mismatch(runtime, checkpoint, declared, active):
    expected = (
        f"Checkpoint config.json declares quant_method='{declared}' but the active quantization config is "
        f"'{active}'. {MISMATCH_TAIL}"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        reconcile_with_checkpoint(runtime, checkpoint)


def test_method_aliases_in_the_checkpoint_are_folded():
    assert (
        reconcile_with_checkpoint(Mxfp4Config(), {"method": "MXFP4", "quant_method": "mxfp4"})
        == Mxfp4Config()
    )
    with pytest.raises(ValueError, match="They are aliases and must agree"):
        reconcile_with_checkpoint(Mxfp4Config(), {"method": "mxfp4", "quant_method": "mxfp4_dualscale"})


# --------------------------------------------------------------------------------------------------
# Method-only checkpoint values leave the runtime config alone
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", ["mxfp4", {"quant_method": "mxfp4"}, {"method": "mxfp4"}])
@pytest.mark.parametrize(
    "runtime",
    [
        RUNTIME,
        Mxfp4Config(is_checkpoint_mxfp4_serialized=True, require_smooth_scale=True, ignored_layers=["a"]),
    ],
)
def test_method_only_checkpoint_keeps_the_runtime_policy(runtime, checkpoint):
    assert reconcile_with_checkpoint(runtime, checkpoint) is runtime


def test_method_only_dualscale_checkpoint_keeps_the_runtime_policy():
    runtime = Mxfp4DualScaleConfig(ignored_layers=["blocks.10.attn1.to_qkv"], num_bf16_fallback_layers=2)
    assert reconcile_with_checkpoint(runtime, "mxfp4_dualscale") is runtime


# --------------------------------------------------------------------------------------------------
# A serialized checkpoint config is the complete storage contract
# --------------------------------------------------------------------------------------------------


def test_serialized_checkpoint_sets_storage_and_runtime_keeps_its_runtime_policies():
    config = reconcile_with_checkpoint(RUNTIME, SERIALIZED_MXFP4)
    assert config == Mxfp4Config(
        is_checkpoint_mxfp4_serialized=True,
        ignored_layers=("blocks.0.attn1.to_qkv", "proj_out"),
        w4a8_fallback_layers=("blocks.10.attn1.to_qkv",),
        w4a8_fallback_steps=(0, 39),
        mxfp4_scale_alg=2,
        backend="auto",  # the checkpoint's (default); VLLM_OMNI_MXFP4_BACKEND chooses it then
    )


def test_serialized_checkpoint_replacing_runtime_ignored_layers_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm_omni_mxfp4.config"):
        reconcile_with_checkpoint(RUNTIME, SERIALIZED_MXFP4)
    assert "replace the runtime's" in caplog.text
    assert "blocks.3.ffn.net_2" in caplog.text


@pytest.mark.parametrize(
    "checkpoint_layers,expected",
    [
        ({"ignored_layers": ["proj_out"]}, ("proj_out",)),
        ({"modules_to_not_convert": ["proj_out"]}, ("proj_out",)),
        ({}, ()),
        ({"ignored_layers": []}, ()),
        ({"ignored_layers": None}, ()),
    ],
)
@pytest.mark.parametrize("cls", [Mxfp4Config, Mxfp4DualScaleConfig])
def test_serialized_checkpoint_ignored_layers_or_alias_omitted_means_none(cls, checkpoint_layers, expected):
    runtime = cls(ignored_layers=["blocks.3.ffn.net_2"])
    checkpoint = {"quant_method": cls.METHOD, runtime.serialized_key(): True, **checkpoint_layers}
    config = reconcile_with_checkpoint(runtime, checkpoint)
    assert config.ignored_layers == expected
    assert config.is_serialized is True


def test_explicit_runtime_w4a8_lists_win_over_saved_ones_including_empty_lists():
    saved = {
        **SERIALIZED_MXFP4,
        "w4a8_fallback_steps": [0, 1],
        "w4a8_fallback_layers": ["blocks.1.ffn.net_2"],
    }
    explicit_empty = parse_quantization(
        {"method": "mxfp4", "w4a8_fallback_steps": [], "w4a8_fallback_layers": []}
    )
    omitted = parse_quantization({"method": "mxfp4"})
    for runtime in (explicit_empty, omitted):
        config = reconcile_with_checkpoint(runtime, saved)
        assert config.w4a8_fallback_steps == ()
        assert config.w4a8_fallback_layers == ()
        assert config.is_checkpoint_mxfp4_serialized is True
    config = reconcile_with_checkpoint(Mxfp4Config(w4a8_fallback_steps=[5]), saved)
    assert config.w4a8_fallback_steps == (5,)


def test_runtime_scale_algorithm_survives_the_rebuild_but_not_its_backend():
    # As vLLM-Omni's resolve_quant_config_from_disk: a rebuild keeps the W4A8 lists and the scale
    # algorithm of the runtime config; the backend comes from the checkpoint (or its default).
    saved = {**SERIALIZED_MXFP4, "mxfp4_scale_alg": 2, "backend": "npu"}
    config = reconcile_with_checkpoint(Mxfp4Config(backend="emulated"), saved)
    assert config.mxfp4_scale_alg == 0
    assert config.backend == "npu"
    config = reconcile_with_checkpoint(Mxfp4Config(mxfp4_scale_alg=2, backend="emulated"), SERIALIZED_MXFP4)
    assert config.mxfp4_scale_alg == 2 and config.scale_rule == "uos"
    assert config.backend == "auto"


def test_no_rebuild_keeps_the_whole_runtime_config():
    runtime = Mxfp4Config(
        is_checkpoint_mxfp4_serialized=True,
        ignored_layers=SERIALIZED_MXFP4["ignored_layers"],
        backend="emulated",
    )
    assert reconcile_with_checkpoint(runtime, SERIALIZED_MXFP4) is runtime


@pytest.mark.parametrize(
    "runtime_smooth,checkpoint_smooth,expected",
    [
        (False, None, False),
        (False, False, False),
        (False, True, True),
        (True, None, True),
        (True, False, True),
        (True, True, True),
    ],
)
def test_require_smooth_scale_true_from_either_side_wins(runtime_smooth, checkpoint_smooth, expected):
    runtime = Mxfp4Config(is_checkpoint_mxfp4_serialized=runtime_smooth, require_smooth_scale=runtime_smooth)
    checkpoint = dict(SERIALIZED_MXFP4)
    if checkpoint_smooth is not None:
        checkpoint["require_smooth_scale"] = checkpoint_smooth
    assert reconcile_with_checkpoint(runtime, checkpoint).require_smooth_scale is expected


@pytest.mark.parametrize("value", ["true", 1, None])
def test_checkpoint_require_smooth_scale_must_be_a_boolean(value):
    with pytest.raises(ValueError, match="require_smooth_scale must be a boolean"):
        reconcile_with_checkpoint(Mxfp4Config(), {**SERIALIZED_MXFP4, "require_smooth_scale": value})


def test_dualscale_serialized_checkpoint_rebuild_takes_the_checkpoints_other_keys():
    runtime = Mxfp4DualScaleConfig(num_bf16_fallback_layers=2, backend="emulated")
    config = reconcile_with_checkpoint(runtime, {**SERIALIZED_DUAL, "num_bf16_fallback_layers": 9})
    assert config == Mxfp4DualScaleConfig(
        is_checkpoint_serialized=True,
        ignored_layers=SERIALIZED_DUAL["ignored_layers"],
        num_bf16_fallback_layers=9,
        backend="auto",
    )


def test_dualscale_checkpoint_with_w4a8_lists_is_rejected():
    with pytest.raises(ValueError, match="mxfp4_dualscale does not support W4A8 fallback"):
        reconcile_with_checkpoint(Mxfp4DualScaleConfig(), {**SERIALIZED_DUAL, "w4a8_fallback_steps": [0]})
    with pytest.raises(ValueError, match="mxfp4_dualscale does not support W4A8 fallback"):
        reconcile_with_checkpoint(None, {**SERIALIZED_DUAL, "w4a8_fallback_layers": ["blocks.1.ffn.net_2"]})


def test_relabelled_dualscale_checkpoint_is_caught_by_strict_keys():
    relabelled = {**SERIALIZED_DUAL, "quant_method": "mxfp4"}
    with pytest.raises(ValueError, match="Did you mean 'is_checkpoint_mxfp4_serialized'"):
        reconcile_with_checkpoint(Mxfp4Config(), relabelled)


# --------------------------------------------------------------------------------------------------
# Online checkpoint configs
# --------------------------------------------------------------------------------------------------


def test_online_checkpoint_config_with_other_ignored_layers_wins(caplog):
    checkpoint = {
        "quant_method": "mxfp4",
        "is_checkpoint_mxfp4_serialized": False,
        "ignored_layers": ["proj_out"],
    }
    with caplog.at_level(logging.WARNING, logger="vllm_omni_mxfp4.config"):
        config = reconcile_with_checkpoint(RUNTIME, checkpoint)
    assert config.ignored_layers == ("proj_out",)
    assert config.w4a8_fallback_steps == RUNTIME.w4a8_fallback_steps
    assert config.mxfp4_scale_alg == RUNTIME.mxfp4_scale_alg and config.backend == "auto"
    assert "['proj_out']" in caplog.text


@pytest.mark.parametrize(
    "runtime,checkpoint",
    [
        (Mxfp4Config(ignored_layers=["proj_out"]), {"quant_method": "mxfp4", "backend": "emulated"}),
        (
            Mxfp4Config(ignored_layers=["proj_out"], backend="npu"),
            {"quant_method": "mxfp4", "mxfp4_scale_alg": 2},
        ),
        (
            Mxfp4DualScaleConfig(ignored_layers=["proj_out"]),
            {
                "quant_method": "mxfp4_dualscale",
                "is_checkpoint_serialized": False,
                "num_bf16_fallback_layers": 2,
            },
        ),
    ],
)
def test_online_checkpoint_config_without_ignored_layers_keeps_the_runtime_config(runtime, checkpoint):
    """It states no BF16 layers, so vLLM-Omni does not rebuild (checked against vLLM-Omni 0.30)."""
    assert reconcile_with_checkpoint(runtime, checkpoint) is runtime


def test_online_checkpoint_config_with_the_same_ignored_layers_keeps_the_runtime_config():
    checkpoint = {"quant_method": "mxfp4", "ignored_layers": list(RUNTIME.ignored_layers)}
    assert reconcile_with_checkpoint(RUNTIME, checkpoint) is RUNTIME


def test_runtime_claiming_serialized_weights_against_an_online_checkpoint():
    runtime = Mxfp4Config(is_checkpoint_mxfp4_serialized=True)
    with pytest.raises(ValueError, match="declares unquantized \\(online\\) weights"):
        reconcile_with_checkpoint(runtime, {"quant_method": "mxfp4", "is_checkpoint_mxfp4_serialized": False})
    with pytest.raises(ValueError, match="is_checkpoint_serialized=true"):
        reconcile_with_checkpoint(
            Mxfp4DualScaleConfig(is_checkpoint_serialized=True),
            {"quant_method": "mxfp4_dualscale", "ignored_layers": []},
        )


def test_online_checkpoint_cannot_require_smooth():
    with pytest.raises(ValueError, match="require_smooth_scale requires an offline MXFP4 checkpoint"):
        reconcile_with_checkpoint(Mxfp4Config(), {"quant_method": "mxfp4", "require_smooth_scale": True})


# --------------------------------------------------------------------------------------------------
# Malformed inputs
# --------------------------------------------------------------------------------------------------


def test_checkpoint_dict_without_a_method():
    with pytest.raises(ValueError, match="has no 'quant_method'"):
        reconcile_with_checkpoint(Mxfp4Config(), {"is_checkpoint_mxfp4_serialized": True})


@pytest.mark.parametrize("checkpoint", [3, ["mxfp4"], True])
def test_checkpoint_of_the_wrong_type(checkpoint):
    with pytest.raises(TypeError, match="quantization_config must be a dict, a method name or None"):
        reconcile_with_checkpoint(Mxfp4Config(), checkpoint)


def test_runtime_of_the_wrong_type():
    with pytest.raises(TypeError, match="runtime must be"):
        reconcile_with_checkpoint({"method": "mxfp4"}, None)
    with pytest.raises(TypeError, match="runtime must be"):
        reconcile_with_checkpoint(ComponentConfigs({}), None)


def test_unknown_key_in_the_checkpoint():
    with pytest.raises(
        ValueError, match="Unknown key in the 'mxfp4' quantization config: 'weight_block_size'"
    ):
        reconcile_with_checkpoint(Mxfp4Config(), {**SERIALIZED_MXFP4, "weight_block_size": [1, 32]})


# --------------------------------------------------------------------------------------------------
# Per-expert resolution
# --------------------------------------------------------------------------------------------------

EXPERT_1 = {**SERIALIZED_DUAL, "ignored_layers": ["blocks.0.attn1.to_qkv"]}
EXPERT_2 = {**SERIALIZED_DUAL, "ignored_layers": ["blocks.39.ffn.net_2", "proj_out"]}


def test_auto_detection_resolves_each_expert_independently():
    first = resolve_component(None, "transformer", EXPERT_1)
    second = resolve_component(None, "transformer_2", EXPERT_2)
    assert first.ignored_layers == ("blocks.0.attn1.to_qkv",)
    assert second.ignored_layers == ("blocks.39.ffn.net_2", "proj_out")


def test_global_runtime_config_applies_to_both_experts_with_their_own_storage():
    runtime = Mxfp4DualScaleConfig(ignored_layers=["blocks.5.attn2.to_q"])
    first = resolve_component(runtime, "transformer", EXPERT_1)
    second = resolve_component(runtime, "transformer_2", EXPERT_2)
    assert first.is_checkpoint_serialized and second.is_checkpoint_serialized
    assert first.ignored_layers == ("blocks.0.attn1.to_qkv",)
    assert second.ignored_layers == ("blocks.39.ffn.net_2", "proj_out")


def test_per_component_configs_select_by_exact_name():
    spec = parse_quantization(
        {
            "transformer": {"method": "mxfp4", "w4a8_fallback_steps": [0]},
            "transformer_2": {"method": "mxfp4", "w4a8_fallback_layers": ["blocks.2.ffn.net_2"]},
        }
    )
    first = resolve_component(spec, "transformer", "mxfp4")
    second = resolve_component(spec, "transformer_2", None)
    assert first == Mxfp4Config(w4a8_fallback_steps=(0,))
    assert second == Mxfp4Config(w4a8_fallback_layers=("blocks.2.ffn.net_2",))


def test_partial_expert_config_does_not_match_its_sibling():
    spec = parse_quantization({"transformer": "mxfp4"})
    assert resolve_component(spec, "transformer", None) == Mxfp4Config()
    assert resolve_component(spec, "transformer_2", None) is None
    with pytest.raises(ValueError, match=re.escape(DISABLED_MSG)):
        resolve_component(spec, "transformer_2", SERIALIZED_MXFP4)


def test_default_reaches_unlisted_experts():
    spec = parse_quantization({"transformer": None, "default": {"method": "mxfp4", "mxfp4_scale_alg": 2}})
    assert resolve_component(spec, "transformer_2", SERIALIZED_MXFP4).mxfp4_scale_alg == 2
    assert resolve_component(spec, "transformer_2", SERIALIZED_MXFP4).is_serialized is True


@pytest.mark.parametrize("checkpoint", ["mxfp4", SERIALIZED_DUAL, {"quant_method": "fp8"}, "fp8"])
def test_disabled_component_requires_a_bf16_checkpoint(checkpoint):
    spec = parse_quantization({"transformer": "mxfp4", "transformer_2": None})
    with pytest.raises(ValueError, match=re.escape(DISABLED_MSG)):
        resolve_component(spec, "transformer_2", checkpoint)


@pytest.mark.parametrize("checkpoint", [None, {}])
def test_disabled_component_with_a_bf16_checkpoint(checkpoint):
    spec = parse_quantization({"transformer": "mxfp4", "transformer_2": None})
    assert resolve_component(spec, "transformer_2", checkpoint) is None


def test_resolve_component_reports_mismatches():
    spec = parse_quantization({"transformer": "mxfp4"})
    with pytest.raises(ValueError, match=re.escape(MISMATCH_TAIL)):
        resolve_component(spec, "transformer", SERIALIZED_DUAL)
