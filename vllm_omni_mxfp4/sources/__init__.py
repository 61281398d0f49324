"""Checkpoint sources in other producers' formats, normalised to what our formats consume.

A source package answers two questions for one family of foreign checkpoints, without loading a
model: *what is in this checkpoint* (detection: a typed description of every layer, refusing
what cannot be reproduced exactly) and *how do its tensors become our canonical tensors*
(layouts: nibble order, scale swizzle, global scales, fused rows). The numerics that follow live
in :mod:`vllm_omni_mxfp4.formats`.

- :mod:`.nvfp4`: NVFP4 checkpoints from ModelOpt (flat ``config.json`` and nested
  ``hf_quant_config.json``, SGLang's re-packed variants), compressed-tensors and Comfy /
  comfy-kitchen, for requantization to MXFP4 (docs/nvfp4.md).
"""
