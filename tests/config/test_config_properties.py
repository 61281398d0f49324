"""Property tests: any JSON-like input yields a config or a ValueError/TypeError with a message."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_omni_mxfp4.config import (
    ComponentConfigs,
    Mxfp4Config,
    Mxfp4DualScaleConfig,
    Precision,
    parse_quantization,
    reconcile_with_checkpoint,
    resolve_component,
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

KEYS = sorted(set(Mxfp4Config.valid_keys()) | set(Mxfp4DualScaleConfig.valid_keys()))
NEAR_VALUES = st.sampled_from(
    ["mxfp4", "mxfp4_dualscale", "none", "fp8", "auto", "emulated", "blocks.0.attn1.to_qkv", "blocks.0.attn1.to_q",
     "proj_out", "transformer.blocks.1.ffn.net_2", "blocks.*", 0, 2, 5, -1, True, False, None, 2.0]
)  # fmt: skip
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | NEAR_VALUES
JSON_LIKE = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.text(max_size=12) | st.sampled_from(KEYS), children, max_size=5)
    ),
    max_leaves=25,
)
LAYERS = st.lists(st.sampled_from(["blocks.0.ffn.net_2", "blocks.3.attn1.to_qkv", "proj_out"]), max_size=3)
STEPS = st.lists(st.integers(0, 40), max_size=4)
VALID_VALUES = {
    "is_checkpoint_mxfp4_serialized": st.booleans(),
    "is_checkpoint_serialized": st.booleans(),
    "require_smooth_scale": st.booleans(),
    "ignored_layers": LAYERS,
    "modules_to_not_convert": LAYERS,
    "w4a8_fallback_layers": LAYERS,
    "w4a8_fallback_steps": STEPS,
    "mxfp4_scale_alg": st.sampled_from([0, 2]),
    "num_bf16_fallback_layers": st.integers(0, 40),
    "backend": st.sampled_from(["auto", "npu", "rocm", "emulated"]),
}
FIELD_VALUES = NEAR_VALUES | st.lists(NEAR_VALUES | st.integers(0, 50), max_size=4) | JSON_LIKE
ENTRY = st.sampled_from(sorted(VALID_VALUES)).flatmap(
    lambda key: st.tuples(st.just(key), st.one_of(VALID_VALUES[key], VALID_VALUES[key], FIELD_VALUES))
)
METHODS = st.sampled_from(
    ["mxfp4", "mxfp4_dualscale", "mxfp4", "mxfp4_dualscale", "MXFP4", "fp8", "", None, 4]
)
CONFIG_LIKE = st.builds(
    lambda method_key, method, entries: (
        {**dict(entries), method_key: method} if method_key else dict(entries)
    ),
    st.sampled_from(["method", "quant_method", "quant_method", None]),
    METHODS,
    st.lists(ENTRY, max_size=4),
)
COMPONENT_LIKE = st.dictionaries(
    st.sampled_from(["transformer", "transformer_2", "default", "vae"]),
    st.none() | st.sampled_from(["mxfp4", "mxfp4_dualscale", "none"]) | CONFIG_LIKE,
    max_size=3,
)
ANY_SPEC = JSON_LIKE | CONFIG_LIKE | COMPONENT_LIKE

RESULT_TYPES = (Mxfp4Config, Mxfp4DualScaleConfig, ComponentConfigs, type(None))


def _outcome(fn, *args):
    """The result, or the error after checking it is a ValueError/TypeError with a message."""
    try:
        return fn(*args)
    except (ValueError, TypeError) as exc:
        assert str(exc).strip(), f"{type(exc).__name__} without a message"
        return exc


@SETTINGS
@given(ANY_SPEC)
def test_parse_quantization_of_any_json_like_value(spec):
    result = _outcome(parse_quantization, spec)
    if not isinstance(result, Exception):
        assert isinstance(result, RESULT_TYPES)


@SETTINGS
@given(ANY_SPEC)
def test_parse_quantization_of_any_json_text(spec):
    result = _outcome(parse_quantization, json.dumps(spec))
    if not isinstance(result, Exception):
        assert isinstance(result, RESULT_TYPES)
        assert result == _outcome(parse_quantization, spec)


@SETTINGS
@given(st.text(max_size=40))
def test_parse_quantization_of_any_string(text):
    result = _outcome(parse_quantization, text)
    assert isinstance(result, (Exception, *RESULT_TYPES))


@SETTINGS
@given(CONFIG_LIKE | JSON_LIKE)
def test_from_dict_of_any_json_like_value(spec):
    for cls in (Mxfp4Config, Mxfp4DualScaleConfig):
        result = _outcome(cls.from_dict, spec)
        if not isinstance(result, Exception):
            assert type(result) is cls
            assert cls.from_dict(json.loads(json.dumps(result.to_dict()))) == result


@SETTINGS
@given(CONFIG_LIKE, st.none() | st.sampled_from(["mxfp4", "mxfp4_dualscale"]) | CONFIG_LIKE)
def test_reconcile_of_any_pair(runtime_spec, checkpoint):
    runtime = _outcome(parse_quantization, runtime_spec)
    if isinstance(runtime, (Exception, ComponentConfigs)):
        runtime = None
    result = _outcome(reconcile_with_checkpoint, runtime, checkpoint)
    assert isinstance(result, (Exception, Mxfp4Config, Mxfp4DualScaleConfig, type(None)))
    component = _outcome(
        resolve_component, ComponentConfigs({"transformer": runtime}), "transformer", checkpoint
    )
    assert isinstance(component, (Exception, Mxfp4Config, Mxfp4DualScaleConfig, type(None)))


@SETTINGS
@given(
    st.lists(st.sampled_from(["blocks.0.ffn.net_2", "blocks.1.ffn.net_2", "proj_out"]), max_size=3),
    st.lists(st.sampled_from(["blocks.0.ffn.net_2", "blocks.1.ffn.net_2", "proj_out"]), max_size=3),
    st.lists(st.integers(0, 5), max_size=4),
    st.sampled_from(["blocks.0.ffn.net_2", "blocks.1.ffn.net_2", "proj_out", "blocks.2.attn1.to_qkv"]),
    st.integers(0, 6),
)
def test_precedence_holds_for_any_policy(ignored, a8_layers, a8_steps, prefix, step):
    """BF16 if ignored; else W4A8 if the layer or the step is listed; else W4A4."""
    route = Mxfp4Config(
        ignored_layers=ignored, w4a8_fallback_layers=a8_layers, w4a8_fallback_steps=a8_steps
    ).route(prefix)
    if prefix in ignored:
        expected = Precision.BF16
    elif prefix in a8_layers or step in a8_steps:
        expected = Precision.W4A8
    else:
        expected = Precision.W4A4
    assert route.precision_at(step) is expected
