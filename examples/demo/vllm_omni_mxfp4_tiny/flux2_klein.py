"""Tiny random FLUX.2-klein text-to-image pipeline, as vLLM-Omni's ``Flux2KleinPipeline`` loads it.

Layout (what diffusers' ``Flux2KleinPipeline.save_pretrained`` writes)::

    model_index.json  scheduler/  tokenizer/ text_encoder/ (Qwen3ForCausalLM)
    vae/ (AutoencoderKLFlux2: 32 latent channels, 2x2 patches)  transformer/

The pipeline stacks three hidden states of the Qwen3 text encoder (``text_encoder_out_layers`` in
its config; the released 28-layer encoder uses 9, 18, 27), so the transformer's
``joint_attention_dim`` is three times the encoder's hidden size. The transformer's block Linears
have K and N multiples of 512 (inner dim 4 x 128, MLP ratio 3). Cached under ``tiny_flux2_klein/``
(:mod:`.cache`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cache import cache_root, cached_build, content_key
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
    "text_encoder_out_layers": [1, 2, 2],
}
"""transformers ``Qwen3Config`` (vocabulary from the tokenizer) plus the pipeline's
``text_encoder_out_layers``: hidden states after layer 1 and after layer 2 (twice)."""

TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 128,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 128,
    "num_attention_heads": 4,
    "joint_attention_dim": 3 * TEXT_ENCODER_CONFIG["hidden_size"],
    "timestep_guidance_channels": 256,
    "axes_dims_rope": [32, 32, 32, 32],
    "guidance_embeds": False,
}
"""diffusers ``Flux2Transformer2DModel`` config (klein: no guidance embedding, CFG instead)."""

VAE_CONFIG: dict[str, Any] = {
    "block_out_channels": [8, 8, 8, 8],
    "layers_per_block": 1,
    "latent_channels": 32,
    "norm_num_groups": 4,
}
"""diffusers ``AutoencoderKLFlux2`` config: FLUX.2's 32 latent channels, 8x compression + 2x2 patches."""

SCHEDULER_CONFIG: dict[str, Any] = {
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
"""diffusers ``FlowMatchEulerDiscreteScheduler`` config of FLUX.2."""

TOKENIZER_MAX_LENGTH = 512


def _build_into(out_dir: Path) -> None:
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )

    tokenizer, text_encoder = qwen3_text_encoder(TEXT_ENCODER_CONFIG, TOKENIZER_MAX_LENGTH, SEED + 1)
    pipeline = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=seeded(SEED, lambda: AutoencoderKLFlux2(**VAE_CONFIG).eval()),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=seeded(SEED + 2, lambda: bf16(Flux2Transformer2DModel(**TRANSFORMER_CONFIG))),
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)


def build_tiny_flux2_klein(*, cache_dir: str | Path | None = None) -> Path:
    """Return the directory of the tiny FLUX.2-klein pipeline, building it on first use (cached by
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
    final = cache_root("tiny_flux2_klein", cache_dir) / f"flux2_klein_{content_key(spec)}"
    return cached_build(final, _build_into)
