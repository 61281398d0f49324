"""The harness the demo, the tests and the docs share: tiny models built locally in seconds (no
download), the engine job and the runner that bounds and reaps it.

The tests import this package, never the demo program (:mod:`vllm_omni_mxfp4_demo`), which is one
more user of it.

- :mod:`.wan`: :func:`build_tiny_wan`, the cached tiny two-expert Wan2.2 diffusers pipeline, and
  :func:`tiny_transformer_config`, the one definition of its transformer config (test fixtures
  derive their variants from it); :func:`~.wan.build_tiny_wan_variant`, the I2V-A14B and TI2V-5B
  layouts;
- one module per other model family, each building the diffusers pipeline directory that
  vLLM-Omni's own pipeline class for it loads: :mod:`.qwen_image`, :mod:`.flux` (FLUX.1-dev),
  :mod:`.flux2_klein`, :mod:`.hunyuan_video` (HunyuanVideo-1.5), :mod:`.z_image` (with
  :mod:`.z_image_config`, the vLLM-Omni general plugin it needs); they share :mod:`.cache` (content
  keys, atomic builds) and :mod:`.parts` (offline tokenizers, seeded BF16 modules);
- :mod:`.msmodelslim_export`, :mod:`.msmodelslim_recipes`: real msModelSlim exports of a diffusers
  Wan2.2 pipeline, made on CPU (imported on their own: they need torch, and msModelSlim when run);
- :mod:`.task`, :mod:`.detect`: the synthetic task trained tiny models learn (prompts from a small
  vocabulary, seeded renders of them) and a detector with no learned weights that reads a prompt
  back from the pixels (prompt accuracy); :mod:`.training`, the pieces trained tiny Wan2.2 models
  are taught with (the pipeline's text encoding, flow matching per expert, an exact compact
  cross-attention for training, the VAE and expert loops); :mod:`.trained_wan`, the command that
  trains the tiny Wan2.2 with them from fixed seeds and writes it with a manifest (recipe, measured
  prompt accuracy, SHA-256 of every file); :mod:`.trained_flux`, the same for a tiny FLUX.1-dev
  text-to-image pipeline trained on the task's still images; :mod:`.training_command`, the command
  line and manifest records both commands share;
- :mod:`.engine_job`: ``Omni`` once, frames saved, in a process of its own
  (``python -m vllm_omni_mxfp4_tiny.engine_job JOB.json``);
- :mod:`.runner`: bounded subprocesses whose process groups are reaped (the engine job among them);
  engine jobs are forked from a warm :mod:`.engine_host`, which imports vLLM-Omni once.

Importing this package imports nothing heavy; torch, diffusers, vLLM-Omni and msModelSlim are
imported where a model is built or run.
"""

from .wan import build_tiny_wan, tiny_transformer_config

__all__ = ["build_tiny_wan", "tiny_transformer_config"]
