"""parse_quantization: every spelling of a config, and per-component configs."""

from __future__ import annotations

import json
import re

import pytest

from vllm_omni_mxfp4.config import (
    CONFIG_CLASSES,
    SUPPORTED_METHODS,
    ComponentConfigs,
    Mxfp4Config,
    Mxfp4DualScaleConfig,
    parse_quantization,
)


def test_supported_methods_parse_to_their_config_class():
    assert CONFIG_CLASSES["mxfp4"] is Mxfp4Config
    assert CONFIG_CLASSES["mxfp4_dualscale"] is Mxfp4DualScaleConfig
    for method in SUPPORTED_METHODS:
        config = parse_quantization(method)
        assert type(config) is CONFIG_CLASSES[method] and method == config.METHOD


@pytest.mark.parametrize("spec", [None, "none", "None", " NONE "])
def test_no_quantization(spec):
    assert parse_quantization(spec) is None


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("mxfp4", Mxfp4Config()),
        ("MXFP4", Mxfp4Config()),
        (" mxfp4_dualscale\n", Mxfp4DualScaleConfig()),
    ],
)
def test_method_names(spec, expected):
    assert parse_quantization(spec) == expected


def test_existing_configs_pass_through():
    for config in (Mxfp4Config(mxfp4_scale_alg=2), Mxfp4DualScaleConfig(), ComponentConfigs({}, None)):
        assert parse_quantization(config) is config


@pytest.mark.parametrize("spec", ["fp8", "awq", "mxfp8", "nvfp4"])
def test_methods_of_others_are_rejected_naming_the_supported_ones(spec):
    with pytest.raises(ValueError) as info:
        parse_quantization(spec)
    message = str(info.value)
    assert f"Unknown quantization method '{spec}'" in message
    assert "Supported: mxfp4, mxfp4_dualscale" in message


def test_method_typo_suggestion():
    with pytest.raises(ValueError, match=re.escape("Did you mean 'mxfp4_dualscale'?")):
        parse_quantization("mxfp4_dualscal")
    with pytest.raises(ValueError, match=re.escape("Did you mean 'mxfp4'?")):
        parse_quantization({"method": "mxpf4"})


@pytest.mark.parametrize("spec", [{"method": "fp8"}, {"quant_method": "fp8", "activation_scheme": "dynamic"}])
def test_foreign_method_in_a_dict(spec):
    with pytest.raises(ValueError, match="Unknown quantization method 'fp8'"):
        parse_quantization(spec)


def test_json_string_from_the_guide():
    config = parse_quantization('{"method":"mxfp4","w4a8_fallback_steps":[0,2]}')
    assert config == Mxfp4Config(w4a8_fallback_steps=(0, 2))
    dual = parse_quantization('{"method":"mxfp4_dualscale","ignored_layers":["blocks.0.attn1.to_qkv"]}')
    assert dual == Mxfp4DualScaleConfig(ignored_layers=("blocks.0.attn1.to_qkv",))


def test_json_string_of_a_method_name():
    assert parse_quantization('"mxfp4"') == Mxfp4Config()


def test_invalid_json():
    with pytest.raises(ValueError, match="The quantization config string is not valid JSON"):
        parse_quantization('{"method": "mxfp4",}')


def test_json_file(tmp_path):
    path = tmp_path / "quant.json"
    path.write_text(json.dumps({"method": "mxfp4", "w4a8_fallback_layers": ["blocks.10.attn1.to_qkv"]}))
    assert parse_quantization(str(path)) == Mxfp4Config(w4a8_fallback_layers=("blocks.10.attn1.to_qkv",))


def test_json_file_with_per_component_configs(tmp_path):
    path = tmp_path / "quant.json"
    path.write_text(json.dumps({"transformer": "mxfp4", "transformer_2": None}))
    parsed = parse_quantization(str(path))
    assert parsed == ComponentConfigs({"transformer": Mxfp4Config(), "transformer_2": None}, None)


def test_json_file_errors(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(
        ValueError, match=re.escape(f"Quantization config file '{missing}' does not exist or is not a file.")
    ):
        parse_quantization(str(missing))
    with pytest.raises(ValueError, match="is not a file"):
        parse_quantization(str(tmp_path) + "/")
    broken = tmp_path / "broken.json"
    broken.write_text("{method: mxfp4}")
    with pytest.raises(ValueError, match=re.escape(f"Quantization config file '{broken}' is not valid JSON")):
        parse_quantization(str(broken))
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="Cannot read quantization config file"):
        parse_quantization(str(binary))
    bad_content = tmp_path / "bad.json"
    bad_content.write_text('{"method": "mxfp4", "w4a8_fallback_steps": [-1]}')
    with pytest.raises(ValueError, match="w4a8_fallback_steps must be a list of non-negative integer"):
        parse_quantization(str(bad_content))


@pytest.mark.parametrize("spec", [3, 2.5, True, ["mxfp4"], b"mxfp4", object()])
def test_wrong_python_types(spec):
    with pytest.raises(TypeError, match="A quantization config must be None, a method name"):
        parse_quantization(spec)


@pytest.mark.parametrize("text", ["[]", '["mxfp4"]', ' [{"method": "mxfp4"}]'])
def test_json_arrays_are_rejected(text):
    with pytest.raises(TypeError, match="A quantization config must be None, a method name"):
        parse_quantization(text)


def test_json_null_is_no_quantization():
    assert parse_quantization("null") is None
    assert (
        parse_quantization('{"transformer": null, "default": "mxfp4"}').for_component("transformer") is None
    )


def test_empty_dict_and_string():
    with pytest.raises(ValueError, match="Empty quantization config"):
        parse_quantization({})
    with pytest.raises(ValueError, match="Unknown quantization method ''"):
        parse_quantization("")


@pytest.mark.parametrize(
    "spec,keys",
    [
        ({"w4a8_fallback_steps": [0]}, "['w4a8_fallback_steps']"),
        ({"ignored_layers": None, "transformer": "mxfp4"}, "['ignored_layers']"),
        ({"num_bf16_fallback_layers": 3, "is_checkpoint_mxfp4_serialized": True},
         "['is_checkpoint_mxfp4_serialized', 'num_bf16_fallback_layers']"),
    ],
)  # fmt: skip
def test_flat_dict_without_a_method(spec, keys):
    with pytest.raises(ValueError) as info:
        parse_quantization(spec)
    assert f"has keys {keys} but no 'method' (or 'quant_method')" in str(info.value)


def test_non_string_keys():
    with pytest.raises(TypeError, match="keys must be strings"):
        parse_quantization({1: "mxfp4"})


# --------------------------------------------------------------------------------------------------
# Per-component configs
# --------------------------------------------------------------------------------------------------


def test_per_component_dict():
    spec = {
        "transformer": {"method": "mxfp4", "w4a8_fallback_steps": [0, 1]},
        "transformer_2": {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 2},
        "default": "mxfp4",
    }
    parsed = parse_quantization(spec)
    assert isinstance(parsed, ComponentConfigs)
    assert parsed.for_component("transformer") == Mxfp4Config(w4a8_fallback_steps=(0, 1))
    assert parsed.for_component("transformer_2") == Mxfp4DualScaleConfig(num_bf16_fallback_layers=2)
    assert parsed.for_component("vae") == Mxfp4Config()
    assert parsed.default == Mxfp4Config()
    assert set(parsed.components) == {"transformer", "transformer_2"}
    assert parse_quantization(json.dumps(spec)) == parsed


def test_per_component_selects_by_exact_name():
    parsed = parse_quantization({"transformer": "mxfp4"})
    assert parsed.for_component("transformer") == Mxfp4Config()
    assert parsed.for_component("transformer_2") is None
    assert parsed.for_component("transforme") is None
    parsed = parse_quantization({"transformer_2": "mxfp4_dualscale", "default": "mxfp4"})
    assert parsed.for_component("transformer") == Mxfp4Config()
    assert parsed.for_component("transformer_2") == Mxfp4DualScaleConfig()


@pytest.mark.parametrize("disabled", [None, "none"])
def test_per_component_null_disables_the_component(disabled):
    parsed = parse_quantization({"transformer": "mxfp4", "transformer_2": disabled, "default": "mxfp4"})
    assert parsed.for_component("transformer_2") is None
    assert parsed.for_component("transformer_3") == Mxfp4Config()


def test_per_component_errors():
    with pytest.raises(ValueError, match="cannot hold per-component configs"):
        parse_quantization({"transformer": {"inner": "mxfp4"}})
    with pytest.raises(ValueError, match="the value of 'transformer' must be a method name, a dict or null"):
        parse_quantization({"transformer": ["mxfp4"]})
    with pytest.raises(ValueError, match="Unknown quantization method 'fp8'"):
        parse_quantization({"transformer": "fp8"})
    with pytest.raises(ValueError, match="Unknown key in the 'mxfp4' quantization config: 'steps'"):
        parse_quantization({"transformer": {"method": "mxfp4", "steps": [1]}})


def test_component_configs_round_trip():
    parsed = parse_quantization(
        {"transformer": {"method": "mxfp4", "mxfp4_scale_alg": 2}, "transformer_2": None, "default": None}
    )
    assert parsed.to_dict() == {
        "transformer": Mxfp4Config(mxfp4_scale_alg=2).to_dict(),
        "transformer_2": None,
        "default": None,
    }
    assert parse_quantization(json.loads(json.dumps(parsed.to_dict()))) == parsed


def test_component_configs_validation():
    with pytest.raises(ValueError, match="not as a component"):
        ComponentConfigs({"default": Mxfp4Config()})
    with pytest.raises(TypeError, match="must be a quantization config or None"):
        ComponentConfigs({"transformer": {"method": "mxfp4"}})
    with pytest.raises(ValueError, match="non-empty string"):
        ComponentConfigs({"": Mxfp4Config()})
    with pytest.raises(TypeError, match="components must be a mapping"):
        ComponentConfigs([("transformer", Mxfp4Config())])


def test_component_configs_are_read_only():
    parsed = ComponentConfigs({"transformer": Mxfp4Config()})
    with pytest.raises(TypeError):
        parsed.components["transformer_2"] = Mxfp4Config()


def test_check_names_catches_typos():
    parsed = parse_quantization({"transfomer": "mxfp4", "transformer_2": "mxfp4"})
    with pytest.raises(ValueError) as info:
        parsed.check_names(["transformer", "transformer_2"])
    message = str(info.value)
    assert "Unknown component 'transfomer'. Did you mean 'transformer'?" in message
    assert "Known components: transformer, transformer_2." in message
    parse_quantization({"transformer": "mxfp4"}).check_names(["transformer", "transformer_2"])


def test_strings_inside_json_are_method_names_only(tmp_path):
    """A JSON file naming itself (or another file) must not be followed: no loops, no surprises."""
    path = tmp_path / "loop.json"
    path.write_text(json.dumps(str(path)))
    with pytest.raises(ValueError, match=re.escape(f"Unknown quantization method '{str(path).lower()}'")):
        parse_quantization(str(path))
    path.write_text(json.dumps({"transformer": str(path)}))
    with pytest.raises(ValueError, match="Unknown quantization method"):
        parse_quantization(str(path))
    with pytest.raises(ValueError, match="Unknown quantization method"):
        parse_quantization({"transformer": '{"method": "mxfp4"}'})
    path.write_text('"MXFP4"')
    assert parse_quantization(str(path)) == Mxfp4Config()
