"""compressed-tensors NVFP4 layers and configs made by compressed-tensors itself, on the CPU: the
demo's NVFP4 source (:mod:`vllm_omni_mxfp4_tiny.nvfp4_source`), which its ``nvfp4`` mode serves."""

from vllm_omni_mxfp4_tiny.nvfp4_source import ct_config, ct_layer, nvfp4_pipeline

__all__ = ["ct_config", "ct_layer", "nvfp4_pipeline"]
