"""Tiny models for the demo, the tests and the docs: built locally in seconds, no download.

- :mod:`.wan`: :func:`build_tiny_wan`, the cached tiny two-expert Wan2.2 diffusers pipeline, and
  :func:`tiny_transformer_config`, the one definition of its transformer config (test fixtures
  derive their variants from it); :func:`~.wan.build_tiny_wan_variant`, the I2V-A14B and TI2V-5B
  layouts;
- one module per other model family, each building the diffusers pipeline directory that
  vLLM-Omni's own pipeline class for it loads: :mod:`.qwen_image`, :mod:`.flux` (FLUX.1-dev),
  :mod:`.flux2_klein`, :mod:`.hunyuan_video` (HunyuanVideo-1.5), :mod:`.z_image`; they share
  :mod:`.cache` (content keys, atomic builds) and :mod:`.parts` (offline tokenizers, seeded BF16
  modules), and are run end to end by :mod:`vllm_omni_mxfp4_demo.models`;
- :mod:`.msmodelslim_export`: real msModelSlim exports of a diffusers Wan2.2 pipeline, made on CPU
  (imported on its own: it needs torch, and msModelSlim when it runs).
"""

from .wan import build_tiny_wan, tiny_transformer_config

__all__ = ["build_tiny_wan", "tiny_transformer_config"]
