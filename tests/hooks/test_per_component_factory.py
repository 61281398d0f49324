"""Per-component configs through vLLM-Omni's own factory (what ``vllm serve --omni
--diffusion-quantization-config JSON`` and ``Omni(quantization_config=dict)`` call): a bad entry is
refused naming the component and the key, as the package's own parser words it, instead of vLLM-Omni's
generic "Dict quantization config must have a 'method' ..." or Python's "keywords must be strings".

Each bad dict is the valid one below with one entry changed.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.omni

VALID = {
    "transformer": "mxfp4",
    "transformer_2": {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0},
}


def _build(spec):
    from vllm_omni.quantization import build_quant_config

    return build_quant_config(spec)


def test_the_valid_dict_builds_per_component(vllm_env):
    from vllm_omni.quantization.component_config import ComponentQuantizationConfig

    built = _build(VALID)
    assert isinstance(built, ComponentQuantizationConfig)
    assert {k: v.get_name() for k, v in built.component_configs.items()} == {
        "transformer": "mxfp4",
        "transformer_2": "mxfp4_dualscale",
    }


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (
            {"transformer_2": {"transformer": "mxfp4_dualscale"}},
            ValueError,
            "Per-component quantization config: 'transformer_2' cannot hold per-component configs (its value "
            "{'transformer': 'mxfp4_dualscale'} names components, not a method)",
        ),
        (
            {"transformer_2": 4},
            ValueError,
            "Per-component quantization config: the value of 'transformer_2' must be a method name, a dict or "
            "null, got 4.",
        ),
        (
            {"transformer_2": {}},
            ValueError,
            "Per-component quantization config, component 'transformer_2': Empty quantization config: name a "
            "method with 'method'",
        ),
        (
            {"transformer_2": {"num_bf16_fallback_layers": 0}},
            ValueError,
            "Per-component quantization config, component 'transformer_2': The quantization config has keys "
            "['num_bf16_fallback_layers'] but no 'method'",
        ),
        (
            {1: "mxfp4_dualscale"},
            TypeError,
            "Quantization config keys must be strings (component names or config keys), got the int 1 (its "
            "value: 'mxfp4_dualscale'); quote it.",
        ),
        (
            {"": "mxfp4_dualscale"},
            ValueError,
            "Per-component quantization config: a component name must be a non-empty string",
        ),
    ],
    ids=["nested", "integer", "empty-dict", "keys-without-method", "non-string-key", "empty-name"],
)
def test_a_bad_entry_is_named(vllm_env, change, error, message):
    spec = {"transformer": "mxfp4", **change}
    if not any(k in change for k in VALID if k != "transformer"):
        spec["transformer_2"] = VALID["transformer_2"]
    with pytest.raises(error) as info:
        _build(spec)
    assert message in str(info.value)


def test_dicts_that_do_not_name_our_methods_are_left_to_vllm_omni(vllm_env):
    with pytest.raises(ValueError, match="Dict quantization config must have a 'method'"):
        _build({"transformer": {"activation_scheme": "dynamic"}})
