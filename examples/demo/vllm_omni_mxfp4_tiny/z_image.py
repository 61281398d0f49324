"""Tiny random Z-Image text-to-image pipeline, as vLLM-Omni's ``ZImagePipeline`` loads it.

Layout (what diffusers' ``ZImagePipeline.save_pretrained`` writes)::

    model_index.json  scheduler/  tokenizer/ text_encoder/ (Qwen3ForCausalLM)
    vae/ (AutoencoderKL, the FLUX.1 VAE's layout: 16 latent channels, 8x)  transformer/

The pipeline feeds the text encoder's second-last hidden state, so the transformer's
``cap_feat_dim`` is the encoder's hidden size; it decodes with the VAE of FLUX.1 (the same config as
:mod:`.flux`'s). The transformer has dim 768 (6 heads of 128): its FFN hidden size
``int(dim / 3 * 8)`` is 2048, so every Linear it builds with the quantization config has an even K
(dim 512 would give 1365 and is refused). vLLM-Omni 0.30 builds this transformer from
``transformer/config.json`` only with the demo's plugin (:mod:`vllm_omni_mxfp4_tiny.z_image_config`).
Cached under ``tiny_z_image/`` (:mod:`.cache`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cache import cache_root, cached_build, content_key
from .flux import VAE_CONFIG
from .parts import bf16, qwen3_text_encoder, seeded

SEED = 0
_BUILDER_VERSION = 1

TEXT_ENCODER_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}
"""transformers ``Qwen3Config`` (vocabulary and special ids from the tokenizer), as Z-Image's Qwen3-4B."""

TRANSFORMER_CONFIG: dict[str, Any] = {
    "all_patch_size": [2],
    "all_f_patch_size": [1],
    "in_channels": VAE_CONFIG["latent_channels"],
    "dim": 768,
    "n_layers": 1,
    "n_refiner_layers": 1,
    "n_heads": 6,
    "n_kv_heads": 6,
    "cap_feat_dim": TEXT_ENCODER_CONFIG["hidden_size"],
    "axes_dims": [32, 48, 48],
    "axes_lens": [256, 64, 64],
}
"""diffusers ``ZImageTransformer2DModel`` config: one main, one noise-refiner and one context-refiner
block; RoPE tables for 256 caption-then-frame positions and 64 rows and columns of patches."""

SCHEDULER_CONFIG: dict[str, Any] = {"shift": 3.0, "use_dynamic_shifting": False}
"""diffusers ``FlowMatchEulerDiscreteScheduler`` config of Z-Image."""

TOKENIZER_MAX_LENGTH = 512


def _build_into(out_dir: Path) -> None:
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )

    tokenizer, text_encoder = qwen3_text_encoder(TEXT_ENCODER_CONFIG, TOKENIZER_MAX_LENGTH, SEED + 1)
    pipeline = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=seeded(SEED, lambda: AutoencoderKL(**VAE_CONFIG).eval()),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=seeded(SEED + 2, lambda: bf16(ZImageTransformer2DModel(**TRANSFORMER_CONFIG))),
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)


def build_tiny_z_image(*, cache_dir: str | Path | None = None) -> Path:
    """Return the directory of the tiny Z-Image pipeline, building it on first use (cached by
    content, written atomically; ``cache_dir`` overrides the cache root)."""
    spec = {
        "builder": _BUILDER_VERSION,
        "seed": SEED,
        "transformer": TRANSFORMER_CONFIG,
        "text_encoder": TEXT_ENCODER_CONFIG,
        "vae": VAE_CONFIG,
        "scheduler": SCHEDULER_CONFIG,
        "tokenizer_max_length": TOKENIZER_MAX_LENGTH,
    }
    final = cache_root("tiny_z_image", cache_dir) / f"z_image_{content_key(spec)}"
    return cached_build(final, _build_into)
