"""``config.reconcile_with_checkpoint`` mirrors what the engine runs: vLLM-Omni's own reconciliation.

vLLM-Omni's Wan2.2 pipeline reconciles each expert's runtime config with its ``config.json`` through
``vllm_omni.quantization.factory.resolve_quant_config_from_disk``; our pure-Python function must give
the same result, so that the example and the docs report what the engine will do.
"""

from __future__ import annotations

import pytest

from vllm_omni_mxfp4.config import Mxfp4Config, Mxfp4DualScaleConfig, reconcile_with_checkpoint
from vllm_omni_mxfp4.plugin import register

pytestmark = pytest.mark.omni

SERIALIZED = {"quant_method": "mxfp4", "is_checkpoint_mxfp4_serialized": True, "ignored_layers": ["proj_out"]}
SERIALIZED_DUAL = {"quant_method": "mxfp4_dualscale", "is_checkpoint_serialized": True, "ignored_layers": []}

CASES = [
    (None, SERIALIZED),
    (None, SERIALIZED_DUAL),
    (None, "mxfp4"),
    (Mxfp4Config(), None),
    (Mxfp4Config(backend="emulated", mxfp4_scale_alg=2, w4a8_fallback_steps=[0, 3]), SERIALIZED),
    (
        Mxfp4Config(ignored_layers=["blocks.0.ffn.net_2"], w4a8_fallback_layers=["blocks.1.attn2.to_q"]),
        SERIALIZED,
    ),
    (
        Mxfp4Config(is_checkpoint_mxfp4_serialized=True, ignored_layers=["proj_out"], backend="emulated"),
        SERIALIZED,
    ),
    (Mxfp4Config(require_smooth_scale=True, is_checkpoint_mxfp4_serialized=True), SERIALIZED),
    (Mxfp4Config(), {**SERIALIZED, "require_smooth_scale": True}),
    (
        Mxfp4Config(ignored_layers=["proj_out"]),
        {"quant_method": "mxfp4", "ignored_layers": ["blocks.2.ffn.net_2"]},
    ),
    (Mxfp4Config(ignored_layers=["proj_out"]), {"quant_method": "mxfp4"}),
    (Mxfp4Config(backend="emulated"), "mxfp4"),
    (Mxfp4DualScaleConfig(num_bf16_fallback_layers=2, backend="emulated"), SERIALIZED_DUAL),
    (Mxfp4DualScaleConfig(), {**SERIALIZED_DUAL, "num_bf16_fallback_layers": 7}),
    (Mxfp4DualScaleConfig(ignored_layers=["blocks.0.attn1.to_qkv"]), SERIALIZED_DUAL),
]


def _wrap(config):
    from vllm_omni_mxfp4.omni import build_quant_config

    return None if config is None else build_quant_config(config.to_dict())


@pytest.mark.parametrize("runtime,checkpoint", CASES)
def test_same_result_as_vllm_omni(runtime, checkpoint):
    from vllm_omni.quantization.factory import resolve_quant_config_from_disk

    register()
    engine = resolve_quant_config_from_disk(_wrap(runtime), checkpoint)
    ours = reconcile_with_checkpoint(runtime, checkpoint)
    assert (engine is None) == (ours is None)
    if ours is not None:
        assert engine.config == ours


def test_method_mismatch_is_an_error_in_both():
    from vllm_omni.quantization.factory import resolve_quant_config_from_disk

    register()
    with pytest.raises(ValueError, match="Pass a matching --quantization flag"):
        resolve_quant_config_from_disk(_wrap(Mxfp4Config()), SERIALIZED_DUAL)
    with pytest.raises(ValueError, match="Pass a matching --quantization flag"):
        reconcile_with_checkpoint(Mxfp4Config(), SERIALIZED_DUAL)
