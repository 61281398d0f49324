"""The vLLM / vLLM-Omni glue: quantization configs, Linear methods and plugin registration.

The only package of this project that imports vllm or vllm_omni. Importing it registers nothing;
:func:`vllm_omni_mxfp4.plugin.register` (the plugin entry point) does.
"""

from __future__ import annotations

from typing import Any

from .._logging import attach_to_vllm_logging

attach_to_vllm_logging()


def build_quant_config(spec: Any) -> Any:
    """A vLLM ``QuantizationConfig`` for any spec this package accepts.

    ``spec``: a method name, a JSON string, a path to a JSON file, a dict (flat or per-component:
    ``{"transformer": ..., "transformer_2": ..., "default": ...}``) or a config object. Per-component
    specs become vLLM-Omni's ``ComponentQuantizationConfig``. Use it where a JSON string must reach
    ``Omni(quantization_config=...)`` (vLLM-Omni itself treats a string as a method name).
    """
    from vllm_omni.quantization.component_config import ComponentQuantizationConfig

    from ..config import ComponentConfigs, Mxfp4Config, parse_quantization
    from .quant_config import Mxfp4DualScaleQuantizationConfig, Mxfp4QuantizationConfig

    def wrap(cfg):
        if cfg is None:
            return None
        cls = Mxfp4QuantizationConfig if isinstance(cfg, Mxfp4Config) else Mxfp4DualScaleQuantizationConfig
        return cls(cfg)

    parsed = parse_quantization(spec)
    if isinstance(parsed, ComponentConfigs):
        return ComponentQuantizationConfig(
            {name: wrap(cfg) for name, cfg in parsed.components.items()}, wrap(parsed.default)
        )
    return wrap(parsed)
