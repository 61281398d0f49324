"""Every key of the two configs: defaults, accepted and rejected values, error messages, round trips."""

from __future__ import annotations

import json
import re

import pytest

from vllm_omni_mxfp4 import spec
from vllm_omni_mxfp4.config import (
    Mxfp4Config,
    Mxfp4DualScaleConfig,
    parse_quantization,
)

# Fragments of the error messages: the key, what is expected, the fix.
STEPS_MSG = "w4a8_fallback_steps must be a list of non-negative integer denoise step indices"
LAYERS_MSG = "must be a list of non-empty exact runtime Linear paths"
SCALE_ALG_MSG = "mxfp4_scale_alg must be 0 (OCP MX) or 2 (UOS"
DUALSCALE_W4A8_MSG = "mxfp4_dualscale does not support W4A8 fallback. Use mxfp4"
FUSED_QKV_MSG = "Use attn1.to_qkv"
BACKEND_NAMES = ("auto", *spec.BACKENDS)


def _raises(fragment: str):
    return pytest.raises(ValueError, match=re.escape(fragment))


# --------------------------------------------------------------------------------------------------
# Defaults
# --------------------------------------------------------------------------------------------------


def test_mxfp4_defaults():
    config = Mxfp4Config()
    assert config.is_checkpoint_mxfp4_serialized is False
    assert config.ignored_layers == ()
    assert config.w4a8_fallback_layers == ()
    assert config.w4a8_fallback_steps == ()
    assert config.require_smooth_scale is False
    assert config.mxfp4_scale_alg == 0
    assert config.backend == "auto"
    assert config.METHOD == "mxfp4"
    assert config.scale_rule == "floor"
    assert config.is_serialized is False


def test_dualscale_defaults():
    config = Mxfp4DualScaleConfig()
    assert config.is_checkpoint_serialized is False
    assert config.ignored_layers == ()
    assert config.num_bf16_fallback_layers == 5
    assert config.backend == "auto"
    assert config.METHOD == "mxfp4_dualscale"
    assert config.is_serialized is False


@pytest.mark.parametrize("cls", [Mxfp4Config, Mxfp4DualScaleConfig])
def test_from_dict_with_only_the_method_gives_the_defaults(cls):
    assert cls.from_dict({"quant_method": cls.METHOD}) == cls()
    assert cls.from_dict({"method": cls.METHOD}) == cls()
    assert cls.from_dict({}) == cls()


@pytest.mark.parametrize("cls", [Mxfp4Config, Mxfp4DualScaleConfig])
def test_backend_accepts_auto_and_every_kernel_backend_and_names_them_when_wrong(cls):
    for name in BACKEND_NAMES:
        assert cls(backend=name).backend == name
    with pytest.raises(ValueError) as info:
        cls(backend="cuda")
    message = str(info.value)
    assert message.startswith("backend must be one of") and "'cuda'" in message
    assert all(repr(name) in message for name in BACKEND_NAMES)


# --------------------------------------------------------------------------------------------------
# Accepted values: (class, key, given, stored)
# --------------------------------------------------------------------------------------------------

ACCEPTED = [
    (Mxfp4Config, "is_checkpoint_mxfp4_serialized", True, True),
    (Mxfp4Config, "is_checkpoint_mxfp4_serialized", False, False),
    (Mxfp4Config, "ignored_layers", ["blocks.0.attn1.to_qkv", "proj_out"], ("blocks.0.attn1.to_qkv", "proj_out")),
    (Mxfp4Config, "ignored_layers", ("proj_out", "proj_out"), ("proj_out",)),
    (Mxfp4Config, "ignored_layers", [], ()),
    (Mxfp4Config, "ignored_layers", None, ()),
    (Mxfp4Config, "w4a8_fallback_layers", ["blocks.12.ffn.net_2", "blocks.10.attn1.to_qkv"],
     ("blocks.10.attn1.to_qkv", "blocks.12.ffn.net_2")),
    (Mxfp4Config, "w4a8_fallback_layers", ["blocks.3.attn2.to_q", "blocks.3.attn2.to_k", "blocks.3.attn2.to_v"],
     ("blocks.3.attn2.to_k", "blocks.3.attn2.to_q", "blocks.3.attn2.to_v")),
    (Mxfp4Config, "w4a8_fallback_layers", ["blocks.3.ffn.net_0.proj", "blocks.3.attn1.to_out"],
     ("blocks.3.attn1.to_out", "blocks.3.ffn.net_0.proj")),
    (Mxfp4Config, "w4a8_fallback_steps", [39, 0, 1, 38, 1], (0, 1, 38, 39)),
    (Mxfp4Config, "w4a8_fallback_steps", (2,), (2,)),
    (Mxfp4Config, "w4a8_fallback_steps", [], ()),
    (Mxfp4Config, "w4a8_fallback_steps", None, ()),
    (Mxfp4Config, "w4a8_fallback_steps", [10**12], (10**12,)),
    (Mxfp4Config, "mxfp4_scale_alg", 0, 0),
    (Mxfp4Config, "mxfp4_scale_alg", 2, 2),
    *[(Mxfp4Config, "backend", b, b) for b in BACKEND_NAMES],
    (Mxfp4DualScaleConfig, "is_checkpoint_serialized", True, True),
    (Mxfp4DualScaleConfig, "ignored_layers", ["blocks.0.attn1.to_qkv", "blocks.0.attn1.to_out", "proj_out"],
     ("blocks.0.attn1.to_out", "blocks.0.attn1.to_qkv", "proj_out")),
    (Mxfp4DualScaleConfig, "num_bf16_fallback_layers", 0, 0),
    (Mxfp4DualScaleConfig, "num_bf16_fallback_layers", 40, 40),
    *[(Mxfp4DualScaleConfig, "backend", b, b) for b in BACKEND_NAMES],
]  # fmt: skip


@pytest.mark.parametrize("cls,key,given,stored", ACCEPTED)
def test_accepted_value_through_from_dict_and_constructor(cls, key, given, stored):
    from_dict = cls.from_dict({"quant_method": cls.METHOD, key: given})
    assert getattr(from_dict, key) == stored
    assert getattr(cls(**{key: given}), key) == stored


def test_require_smooth_scale_accepted_with_serialized_weights():
    config = Mxfp4Config.from_dict(
        {"quant_method": "mxfp4", "is_checkpoint_mxfp4_serialized": True, "require_smooth_scale": True}
    )
    assert config.require_smooth_scale is True
    assert config.is_serialized is True


def test_scale_rule_of_uos():
    assert Mxfp4Config(mxfp4_scale_alg=2).scale_rule == "uos"


# --------------------------------------------------------------------------------------------------
# Rejected values: (class, key, value, message fragment)
# --------------------------------------------------------------------------------------------------

REJECTED = [
    *[(Mxfp4Config, "is_checkpoint_mxfp4_serialized", v, "is_checkpoint_mxfp4_serialized must be a boolean")
      for v in (1, 0, "true", None, 1.0)],
    *[(Mxfp4Config, "require_smooth_scale", v, "require_smooth_scale must be a boolean")
      for v in (1, "true", "false", None, [])],
    *[(Mxfp4Config, "mxfp4_scale_alg", v, SCALE_ALG_MSG) for v in (True, False, None, "2", 2.0, 1, -1, 3, [2])],
    *[(Mxfp4Config, "w4a8_fallback_steps", v, STEPS_MSG)
      for v in (1, "1", [True], [False], [1.0], [-1], ["0"], [None], {"0": 1}, [[1]], "0,1")],
    *[(Mxfp4Config, "backend", v, "backend must be one of 'auto'")
      for v in ("cuda", "NPU", "", None, 0, ["npu"])],
    *[(Mxfp4DualScaleConfig, "is_checkpoint_serialized", v, "is_checkpoint_serialized must be a boolean")
      for v in (1, "yes", None)],
    *[(Mxfp4DualScaleConfig, "num_bf16_fallback_layers", v, "num_bf16_fallback_layers must be a non-negative integer")
      for v in (True, False, -1, 1.0, "5", None)],
    *[(Mxfp4DualScaleConfig, "backend", v, "backend must be one of") for v in ("xpu", 1)],
]  # fmt: skip


@pytest.mark.parametrize("cls,key,value,fragment", REJECTED)
def test_rejected_value_through_from_dict_and_constructor(cls, key, value, fragment):
    with _raises(fragment):
        cls.from_dict({"quant_method": cls.METHOD, key: value})
    with _raises(fragment):
        cls(**{key: value})


BAD_LAYER_NAMES = [
    ("blocks.*.attn1.to_qkv", "wildcard"),
    ("blocks.1?.ffn.net_2", "wildcard"),
    ("blocks\\.0\\..*", "wildcard"),
    ("blocks.[0-4].ffn.net_2", "wildcard"),
    ("blocks.0.attn1.to_qkv.weight", "without '.weight'"),
    ("blocks.0.ffn.net_2.bias", "without '.bias'"),
    ("transformer.blocks.0.attn1.to_qkv", "use 'blocks.0.attn1.to_qkv'"),
    ("transformer_2.blocks.0.ffn.net_2", "use 'blocks.0.ffn.net_2'"),
    ("blocks.0.attn1.to_q", FUSED_QKV_MSG),
    ("blocks.0.attn1.to_k", "'blocks.0.attn1.to_qkv'"),
    ("blocks.11.attn1.to_v", "'blocks.11.attn1.to_qkv'"),
    ("attn1.to_q", FUSED_QKV_MSG),
    ("", "is empty"),
    ("   ", "is empty"),
    ("blocks..0", "not a dotted module path"),
    ("blocks.0.", "not a dotted module path"),
    (".blocks.0", "not a dotted module path"),
    ("0.blocks", "not a dotted module path"),
    ("blocks 0", "not a dotted module path"),
    ("blocks/0/ffn", "not a dotted module path"),
    (3, "is not a string"),
    (None, "is not a string"),
    (["blocks.0.ffn.net_2"], "is not a string"),
]


@pytest.mark.parametrize("key", ["ignored_layers", "w4a8_fallback_layers", "modules_to_not_convert"])
@pytest.mark.parametrize("name,fragment", BAD_LAYER_NAMES)
def test_mxfp4_rejects_bad_layer_names(key, name, fragment):
    with pytest.raises(ValueError) as info:
        Mxfp4Config.from_dict({"quant_method": "mxfp4", key: ["proj_out", name]})
    message = str(info.value)
    assert message.startswith(f"{key} {LAYERS_MSG}")
    assert fragment in message


@pytest.mark.parametrize("name,fragment", BAD_LAYER_NAMES)
def test_dualscale_rejects_bad_ignored_layer_names(name, fragment):
    with pytest.raises(ValueError) as info:
        Mxfp4DualScaleConfig.from_dict({"quant_method": "mxfp4_dualscale", "ignored_layers": [name]})
    assert fragment in str(info.value)
    assert str(info.value).startswith(f"ignored_layers {LAYERS_MSG}")


@pytest.mark.parametrize("value", ["blocks.0.attn1.to_qkv", 3, {"blocks.0.ffn.net_2": True}, True])
@pytest.mark.parametrize("key", ["ignored_layers", "w4a8_fallback_layers"])
def test_layer_lists_must_be_lists(key, value):
    with _raises(f"{key} {LAYERS_MSG}"):
        Mxfp4Config.from_dict({"quant_method": "mxfp4", key: value})


def test_fused_qkv_message_names_the_fused_path():
    with pytest.raises(ValueError) as info:
        Mxfp4Config(w4a8_fallback_layers=["blocks.10.attn1.to_k"])
    message = str(info.value)
    assert "attn1.to_qkv" in message
    assert "'blocks.10.attn1.to_qkv'" in message


def test_require_smooth_scale_needs_serialized_weights():
    msg = "require_smooth_scale requires an offline MXFP4 checkpoint"
    with _raises(msg):
        Mxfp4Config(require_smooth_scale=True)
    with _raises(msg):
        Mxfp4Config.from_dict({"method": "mxfp4", "require_smooth_scale": True})
    with _raises(msg):
        parse_quantization(
            '{"method": "mxfp4", "require_smooth_scale": true, "is_checkpoint_mxfp4_serialized": false}'
        )


# --------------------------------------------------------------------------------------------------
# DualScale and W4A8
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"w4a8_fallback_steps": [0]},
        {"w4a8_fallback_layers": ["blocks.10.attn1.to_qkv"]},
        {"w4a8_fallback_steps": [0, 1], "w4a8_fallback_layers": ["blocks.1.ffn.net_2"]},
        {"w4a8_fallback_steps": [3], "is_checkpoint_serialized": True},
    ],
)
def test_dualscale_rejects_nonempty_w4a8_lists(extra):
    spec = {"quant_method": "mxfp4_dualscale", **extra}
    with _raises(DUALSCALE_W4A8_MSG):
        Mxfp4DualScaleConfig.from_dict(spec)
    with _raises(DUALSCALE_W4A8_MSG):
        parse_quantization(spec)
    with _raises(DUALSCALE_W4A8_MSG):
        parse_quantization(json.dumps({"transformer": spec}))


@pytest.mark.parametrize("empty", [[], None, ()])
def test_dualscale_accepts_empty_w4a8_lists(empty):
    config = Mxfp4DualScaleConfig.from_dict(
        {"quant_method": "mxfp4_dualscale", "w4a8_fallback_steps": empty, "w4a8_fallback_layers": empty}
    )
    assert config == Mxfp4DualScaleConfig()
    assert "w4a8_fallback_steps" not in config.to_dict()


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("w4a8_fallback_steps", [-1], STEPS_MSG),
        ("w4a8_fallback_steps", [True], STEPS_MSG),
        ("w4a8_fallback_layers", ["blocks.0.attn1.to_q"], FUSED_QKV_MSG),
    ],
)
def test_dualscale_validates_w4a8_values_before_rejecting_them(key, value, fragment):
    with _raises(fragment):
        Mxfp4DualScaleConfig.from_dict({"quant_method": "mxfp4_dualscale", key: value})


def test_dualscale_has_no_w4a8_fields():
    with pytest.raises(TypeError):
        Mxfp4DualScaleConfig(w4a8_fallback_steps=[0])


# --------------------------------------------------------------------------------------------------
# Keys: aliases, unknown keys, method keys
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [Mxfp4Config, Mxfp4DualScaleConfig])
def test_modules_to_not_convert_is_an_alias_of_ignored_layers(cls):
    config = cls.from_dict({"quant_method": cls.METHOD, "modules_to_not_convert": ["proj_out"]})
    assert config.ignored_layers == ("proj_out",)


@pytest.mark.parametrize(
    "ignored,alias,expected",
    [
        (["proj_out"], ["proj_out"], ("proj_out",)),
        ([], ["proj_out"], ("proj_out",)),
        (["proj_out"], [], ("proj_out",)),
        (None, ["proj_out"], ("proj_out",)),
        (["a.b", "c"], ["c", "a.b"], ("a.b", "c")),
    ],
)
def test_alias_values_that_agree(ignored, alias, expected):
    config = Mxfp4Config.from_dict({"ignored_layers": ignored, "modules_to_not_convert": alias})
    assert config.ignored_layers == expected


def test_alias_values_that_disagree():
    with _raises("ignored_layers / modules_to_not_convert are aliases and must agree"):
        Mxfp4Config.from_dict(
            {"ignored_layers": ["proj_out"], "modules_to_not_convert": ["blocks.0.ffn.net_2"]}
        )


UNKNOWN_KEYS = [
    (Mxfp4Config, "ignore_layers", "ignored_layers"),
    (Mxfp4Config, "w4a8_fallback_step", "w4a8_fallback_steps"),
    (Mxfp4Config, "is_checkpoint_serialized", "is_checkpoint_mxfp4_serialized"),
    (Mxfp4Config, "mxfp4_scale_algo", "mxfp4_scale_alg"),
    (Mxfp4Config, "require_smooth", "require_smooth_scale"),
    (Mxfp4Config, "backends", "backend"),
    (Mxfp4DualScaleConfig, "is_checkpoint_mxfp4_serialized", "is_checkpoint_serialized"),
    (Mxfp4DualScaleConfig, "num_bf16_fallback_layer", "num_bf16_fallback_layers"),
    (Mxfp4DualScaleConfig, "modules_to_not_covert", "modules_to_not_convert"),
]


@pytest.mark.parametrize("cls,key,suggestion", UNKNOWN_KEYS)
def test_unknown_key_names_it_suggests_and_lists_valid_keys(cls, key, suggestion):
    with pytest.raises(ValueError) as info:
        cls.from_dict({"quant_method": cls.METHOD, key: 1})
    message = str(info.value)
    assert message.startswith("Unknown key") and f"'{cls.METHOD}'" in message and f"'{key}'" in message
    assert f"Did you mean '{suggestion}'?" in message
    for valid in ("ignored_layers", "backend", "modules_to_not_convert", "quant_method", "method"):
        assert valid in message


@pytest.mark.parametrize("cls", [Mxfp4Config, Mxfp4DualScaleConfig])
def test_unknown_key_far_from_everything_has_no_suggestion_and_lists_every_valid_key(cls):
    with pytest.raises(ValueError) as info:
        cls.from_dict({"zzz": 1})
    message = str(info.value)
    assert "'zzz'" in message and "Did you mean" not in message
    listed = message.split("Valid keys: ", 1)[1].rstrip(".").split(", ")
    assert listed == sorted(cls.valid_keys())


@pytest.mark.parametrize(
    "cls,key", [(Mxfp4Config, "num_bf16_fallback_layers"), (Mxfp4DualScaleConfig, "mxfp4_scale_alg")]
)
def test_keys_of_the_other_method_are_unknown(cls, key):
    with _raises(f"'{key}'"):
        cls.from_dict({key: 0})


def test_dualscale_does_not_accept_require_smooth_scale():
    with _raises("Unknown key in the 'mxfp4_dualscale' quantization config: 'require_smooth_scale'"):
        Mxfp4DualScaleConfig.from_dict({"require_smooth_scale": False})


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "mxfp4", "quant_method": "mxfp4"},
        {"method": "MXFP4"},
        {"quant_method": " mxfp4 "},
    ],
)
def test_method_keys_are_aliases(spec):
    assert Mxfp4Config.from_dict(spec) == Mxfp4Config()


def test_conflicting_method_keys():
    with pytest.raises(ValueError) as info:
        Mxfp4Config.from_dict({"method": "mxfp4", "quant_method": "mxfp4_dualscale"})
    message = str(info.value)
    assert "method='mxfp4'" in message and "quant_method='mxfp4_dualscale'" in message
    assert "must agree" in message


def test_from_dict_rejects_the_other_method():
    with _raises("declares method 'mxfp4_dualscale', expected 'mxfp4'"):
        Mxfp4Config.from_dict({"quant_method": "mxfp4_dualscale"})


@pytest.mark.parametrize("method", [None, 4, ["mxfp4"]])
def test_method_must_be_a_string(method):
    with _raises("must be a string naming a quantization method"):
        Mxfp4Config.from_dict({"method": method})


@pytest.mark.parametrize("value", [None, ["quant_method"], "mxfp4", 3])
def test_from_dict_needs_a_mapping(value):
    with pytest.raises(TypeError, match="must be a dict"):
        Mxfp4Config.from_dict(value)


# --------------------------------------------------------------------------------------------------
# Frozen, normalized, round trip
# --------------------------------------------------------------------------------------------------


def test_configs_are_frozen():
    config = Mxfp4Config()
    with pytest.raises(AttributeError):
        config.mxfp4_scale_alg = 2


ROUND_TRIP = [
    Mxfp4Config(),
    Mxfp4Config(
        is_checkpoint_mxfp4_serialized=True,
        ignored_layers=("proj_out", "blocks.0.attn1.to_qkv"),
        w4a8_fallback_layers=("blocks.10.attn1.to_qkv",),
        w4a8_fallback_steps=(39, 0),
        require_smooth_scale=True,
        mxfp4_scale_alg=2,
        backend="emulated",
    ),
    Mxfp4DualScaleConfig(),
    Mxfp4DualScaleConfig(
        is_checkpoint_serialized=True, ignored_layers=("blocks.0.ffn.net_2",), backend="npu"
    ),
    Mxfp4DualScaleConfig(num_bf16_fallback_layers=0, backend="rocm"),
]


@pytest.mark.parametrize("config", ROUND_TRIP)
def test_round_trip_through_dict_and_json(config):
    as_dict = config.to_dict()
    assert as_dict["quant_method"] == config.METHOD
    assert type(config).from_dict(as_dict) == config
    assert parse_quantization(json.dumps(as_dict)) == config
    assert parse_quantization(as_dict) == config


def test_to_dict_golden():
    config = Mxfp4Config(ignored_layers=["proj_out"], w4a8_fallback_steps=[2, 0], mxfp4_scale_alg=2)
    assert config.to_dict() == {
        "quant_method": "mxfp4",
        "is_checkpoint_mxfp4_serialized": False,
        "ignored_layers": ["proj_out"],
        "w4a8_fallback_layers": [],
        "w4a8_fallback_steps": [0, 2],
        "require_smooth_scale": False,
        "mxfp4_scale_alg": 2,
        "backend": "auto",
        "nvfp4_requant_rule": "auto",
    }
    assert Mxfp4DualScaleConfig(is_checkpoint_serialized=True).to_dict() == {
        "quant_method": "mxfp4_dualscale",
        "is_checkpoint_serialized": True,
        "ignored_layers": [],
        "num_bf16_fallback_layers": 5,
        "backend": "auto",
    }


def test_equal_lists_in_any_order_give_equal_configs():
    assert Mxfp4Config(w4a8_fallback_steps=[3, 1, 3]) == Mxfp4Config(w4a8_fallback_steps=(1, 3))
    assert Mxfp4Config(ignored_layers=["b", "a"]) == Mxfp4Config(ignored_layers=("a", "b", "a"))


def test_checkpoint_dict_is_the_guides_block():
    dual = Mxfp4DualScaleConfig(
        is_checkpoint_serialized=True,
        ignored_layers=["blocks.0.attn1.to_qkv", "blocks.0.attn1.to_out", "proj_out"],
        num_bf16_fallback_layers=3,
        backend="npu",
    )
    assert dual.to_checkpoint_dict() == {
        "quant_method": "mxfp4_dualscale",
        "is_checkpoint_serialized": True,
        "ignored_layers": ["blocks.0.attn1.to_out", "blocks.0.attn1.to_qkv", "proj_out"],
    }
    single = Mxfp4Config(
        is_checkpoint_mxfp4_serialized=True,
        require_smooth_scale=True,
        w4a8_fallback_steps=[1],
        mxfp4_scale_alg=2,
    )
    assert single.to_checkpoint_dict() == {
        "quant_method": "mxfp4",
        "is_checkpoint_mxfp4_serialized": True,
        "require_smooth_scale": True,
        "ignored_layers": [],
    }
    assert Mxfp4Config.from_dict(json.loads(json.dumps(single.to_checkpoint_dict()))) == Mxfp4Config(
        is_checkpoint_mxfp4_serialized=True, require_smooth_scale=True
    )
