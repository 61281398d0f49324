"""``mxfp8_layers``: the checkpoint's MXFP8 W8A8 layers (issue #15) in the pure configs."""

from __future__ import annotations

import pytest

from vllm_omni_mxfp4.config import Mxfp4Config, Mxfp4DualScaleConfig, Precision, check_model_names
from vllm_omni_mxfp4.config.keys import STORAGE

LAYERS = ["blocks.0.attn1.to_qkv", "blocks.0.ffn.net_2"]
LINEARS = {f"blocks.{b}.{p}" for b in range(2) for p in ("attn1.to_qkv", "attn2.to_q", "ffn.net_2")}


def offline(cls=Mxfp4Config, **kw):
    flag = (
        {"is_checkpoint_mxfp4_serialized": True} if cls is Mxfp4Config else {"is_checkpoint_serialized": True}
    )
    return cls(**flag, **kw)


@pytest.mark.parametrize("cls", [Mxfp4Config, Mxfp4DualScaleConfig])
def test_listed_layers_route_to_w8a8_and_the_others_as_before(cls):
    config = offline(cls, mxfp8_layers=LAYERS, ignored_layers=["blocks.1.attn2.to_q"])
    route = config.route("blocks.0.ffn.net_2")
    assert (route.precision, route.a8_steps, route.reason) == (
        Precision.W8A8,
        (),
        "listed in mxfp8_layers (MXFP8 W8A8)",
    )
    assert config.route("blocks.1.attn2.to_q").precision is Precision.BF16
    assert config.route("blocks.1.ffn.net_2").precision is Precision.W4A4


def test_w4a8_steps_do_not_apply_to_mxfp8_layers_and_the_route_says_so():
    config = offline(mxfp8_layers=LAYERS, w4a8_fallback_steps=[0, 3])
    route = config.route("blocks.0.attn1.to_qkv")
    assert route.precision is Precision.W8A8 and route.a8_steps == ()
    assert route.precision_at(0) is Precision.W8A8
    assert "W4A8 fallback steps [0, 3] do not apply to MXFP8 layers" in route.reason
    assert config.route("blocks.1.attn1.to_qkv").a8_steps == (0, 3)


@pytest.mark.parametrize("cls", [Mxfp4Config, Mxfp4DualScaleConfig])
def test_an_online_config_with_mxfp8_layers_is_refused(cls):
    with pytest.raises(ValueError) as info:
        cls.from_dict({"mxfp8_layers": LAYERS})
    message = str(info.value)
    assert "mxfp8_layers ['blocks.0.attn1.to_qkv', 'blocks.0.ffn.net_2']" in message
    assert "online quantization to MXFP8 is not supported" in message
    assert f"set {cls.serialized_key()}: true" in message


@pytest.mark.parametrize(
    "other,match",
    [
        ("ignored_layers", "in ignored_layers, which stores them in BF16: a layer has one storage format"),
        ("w4a8_fallback_layers", "W4A8 fallback does not apply to MXFP8 layers"),
    ],
)
def test_a_layer_in_mxfp8_layers_and_another_list_is_refused_naming_it(other, match):
    offline(mxfp8_layers=LAYERS, **{other: ["blocks.1.ffn.net_2"]})  # disjoint lists are valid
    with pytest.raises(ValueError, match=match) as info:
        offline(mxfp8_layers=LAYERS, **{other: ["blocks.1.ffn.net_2", "blocks.0.ffn.net_2"]})
    assert str(info.value).startswith("['blocks.0.ffn.net_2'] are listed in mxfp8_layers and in " + other)


def test_checkpoint_names_of_fused_qkv_are_refused_all_or_none():
    with pytest.raises(ValueError, match="self-attention Q/K/V run as one fused Linear") as info:
        offline(mxfp8_layers=["blocks.0.attn1.to_q"])
    assert "'blocks.0.attn1.to_qkv'" in str(info.value)


def test_serialization_writes_the_key_only_when_non_empty():
    plain = offline()
    assert "mxfp8_layers" not in plain.to_dict()
    assert "mxfp8_layers" not in plain.to_checkpoint_dict()
    config = offline(mxfp8_layers=list(reversed(LAYERS)))
    written = config.to_checkpoint_dict()
    assert written["mxfp8_layers"] == LAYERS  # block order
    assert Mxfp4Config.from_dict(written) == config
    assert Mxfp4Config.from_dict(config.to_dict()) == config


def test_the_checkpoint_decides_mxfp8_layers_when_a_runtime_config_is_rebuilt():
    assert Mxfp4Config.__dataclass_fields__["mxfp8_layers"].metadata["role"] is STORAGE
    runtime = offline(w4a8_fallback_steps=[1])
    rebuilt = runtime.rebuilt_from_checkpoint(offline(mxfp8_layers=LAYERS))
    assert rebuilt.mxfp8_layers == tuple(LAYERS) and rebuilt.w4a8_fallback_steps == (1,)


def test_an_entry_naming_no_linear_is_refused_by_the_model_name_check():
    check_model_names(offline(mxfp8_layers=["blocks.0.attn1.to_qkv"]), LINEARS, 2)
    with pytest.raises(ValueError) as info:
        check_model_names(offline(mxfp8_layers=["blocks.0.attn1.to_qkvv"]), LINEARS, 2, model="transformer")
    message = str(info.value)
    assert "mxfp8_layers entry 'blocks.0.attn1.to_qkvv' matches no Linear of transformer" in message
    assert "Did you mean 'blocks.0.attn1.to_qkv'?" in message


def test_an_entry_naming_a_plain_linear_is_refused():
    config = offline(mxfp8_layers=["proj_out"], ignored_layers=["condition_embedder.x"])
    linears = LINEARS | {"proj_out", "condition_embedder.x"}
    check_model_names(offline(ignored_layers=["proj_out"]), linears, 2, plain={"proj_out"})  # BF16: fine
    with pytest.raises(ValueError) as info:
        check_model_names(config, linears, 2, model="transformer", plain={"proj_out", "condition_embedder.x"})
    assert str(info.value).startswith(
        "mxfp8_layers entry 'proj_out' is a plain torch.nn.Linear of transformer, which vLLM-Omni builds "
        "without a quantization method"
    )
