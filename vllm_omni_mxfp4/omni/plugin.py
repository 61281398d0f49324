"""vLLM-Omni general plugin: makes ``mxfp4`` and ``mxfp4_dualscale`` ours in every process.

vLLM-Omni loads entry points of group ``vllm_omni.general_plugins`` once per process (engine,
stage processes, diffusion workers) before it builds quantization configs. :func:`register` adds
our builders through ``vllm_omni.quantization.factory.register_quantization_override``, which only
vLLM-Omni's diffusion factory consults: vLLM core's own ``mxfp4`` (its MoE method for LLM
stages, resolved through vLLM's registry) is left untouched. It also installs the checks of
:mod:`.names`: layer and component names against the model vLLM-Omni builds, and the user guide's
per-component forms in vLLM-Omni's factory.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    """Register the two builders with vLLM-Omni's quantization factory; idempotent."""
    global _registered
    if _registered:
        return
    from vllm_omni.quantization.factory import register_quantization_override

    from .._logging import attach_to_vllm_logging
    from .defaults import install as install_family_defaults
    from .loading import install_load_guard
    from .names import install as install_name_checks
    from .nvfp4_loading import install as install_nvfp4
    from .quant_config import Mxfp4DualScaleQuantizationConfig, Mxfp4QuantizationConfig
    from .text_encoders import install as install_text_encoders

    register_quantization_override("mxfp4", Mxfp4QuantizationConfig.from_kwargs)
    register_quantization_override("mxfp4_dualscale", Mxfp4DualScaleQuantizationConfig.from_kwargs)
    install_name_checks()
    install_family_defaults()  # BF16 layers of published MXFP4 recipes, when no ignored_layers is given
    install_load_guard()  # names the tensor when vLLM's loaders fail; refuses unknown quantized tensors
    install_nvfp4()  # NVFP4 checkpoints: requantized to MXFP4 while they load
    install_text_encoders()  # Hugging Face text encoders whose Linears vLLM-Omni rebuilds: BF16
    attach_to_vllm_logging()
    _registered = True
    logger.debug("vllm-omni-mxfp4: registered mxfp4 and mxfp4_dualscale with vLLM-Omni")
