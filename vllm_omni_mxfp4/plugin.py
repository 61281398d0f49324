"""vLLM-Omni general plugin: makes ``mxfp4`` and ``mxfp4_dualscale`` ours in every process.

vLLM-Omni loads entry points of group ``vllm_omni.general_plugins`` once per process (engine,
stage processes, diffusion workers) before it builds quantization configs. :func:`register` adds
our builders through ``vllm_omni.quantization.factory.register_quantization_override``, which only
vLLM-Omni's diffusion factory consults: vLLM core's own ``mxfp4`` (its MoE method for LLM
stages, resolved through vLLM's registry) is left untouched. It also installs the hooks of
:mod:`vllm_omni_mxfp4.hooks`: layer and component names checked against the model vLLM-Omni builds,
family defaults, NVFP4 checkpoints, the load guard, the user guide's per-component forms.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    """Register the two builders with vLLM-Omni's quantization factory and install the hooks; idempotent."""
    global _registered
    if _registered:
        return
    from vllm_omni.quantization.factory import register_quantization_override

    from . import hooks
    from ._logging import attach_to_vllm_logging
    from .omni.quant_config import Mxfp4DualScaleQuantizationConfig, Mxfp4QuantizationConfig

    register_quantization_override("mxfp4", Mxfp4QuantizationConfig.from_kwargs)
    register_quantization_override("mxfp4_dualscale", Mxfp4DualScaleQuantizationConfig.from_kwargs)
    hooks.install()
    attach_to_vllm_logging()
    _registered = True
    logger.debug("vllm-omni-mxfp4: registered mxfp4 and mxfp4_dualscale with vLLM-Omni")


def engine_quant_config(spec: Any) -> Any:
    """What the engine builds from ``quantization_config=spec``: vLLM-Omni's factory with this
    package registered. Raises the engine's error for a spec the engine refuses."""
    from vllm_omni.quantization.factory import build_quant_config

    register()
    return build_quant_config(spec)
