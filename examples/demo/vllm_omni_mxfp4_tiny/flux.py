"""Tiny random FLUX.1-dev text-to-image pipeline, as vLLM-Omni's ``FluxPipeline`` loads it.

Layout (what diffusers' ``FluxPipeline.save_pretrained`` writes)::

    model_index.json  scheduler/  tokenizer/ text_encoder/ (CLIP)  tokenizer_2/ text_encoder_2/ (T5)
    vae/ (16 latent channels, 8x)  transformer/

The transformer's block Linears have K and N multiples of 512 (inner dim 4 x 128), so both
``mxfp4`` and ``mxfp4_dualscale`` apply to each; ``joint_attention_dim`` equals T5's ``d_model`` and
``pooled_projection_dim`` CLIP's hidden size, as in the released model; the text encoders are stored
in BF16 like the released ones (vLLM-Omni loads them in their stored dtype). Cached under
``tiny_flux/`` like the Wan pipelines (:mod:`.cache`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cache import cache_root, cached_build, content_key
from .parts import bf16, clip_tokenizer, seeded, t5_tokenizer, vocab_size

SEED = 0
_BUILDER_VERSION = 1

TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 128,
    "num_attention_heads": 4,
    "joint_attention_dim": 64,
    "pooled_projection_dim": 32,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}
"""diffusers ``FluxTransformer2DModel`` config (FLUX.1-dev's guidance embedding, 1 + 1 blocks)."""

CLIP_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "max_position_embeddings": 77,
    "projection_dim": 32,
}
"""transformers ``CLIPTextConfig`` (vocabulary size and special ids come from the tokenizer)."""

T5_CONFIG: dict[str, Any] = {
    "d_model": 64,
    "d_kv": 16,
    "d_ff": 128,
    "num_layers": 1,
    "num_heads": 4,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
}
"""transformers ``T5Config`` of the T5 v1.1 encoder (gated GELU, as T5-XXL)."""

VAE_CONFIG: dict[str, Any] = {
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [8, 8, 8, 8],
    "layers_per_block": 1,
    "latent_channels": 16,
    "norm_num_groups": 4,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
"""diffusers ``AutoencoderKL`` config: FLUX's 16 latent channels and 8x compression, 8 channels wide."""

SCHEDULER_CONFIG: dict[str, Any] = {
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
"""diffusers ``FlowMatchEulerDiscreteScheduler`` config of FLUX.1-dev."""


def _build_into(out_dir: Path) -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer()
    clip = CLIPTextConfig(
        **CLIP_CONFIG,
        vocab_size=vocab_size(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    t5 = T5Config(**T5_CONFIG, vocab_size=vocab_size(tokenizer_2), pad_token_id=0, eos_token_id=1)
    pipeline = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        text_encoder=seeded(SEED, lambda: bf16(CLIPTextModel(clip))),
        tokenizer=tokenizer,
        text_encoder_2=seeded(SEED + 1, lambda: bf16(T5EncoderModel(t5))),
        tokenizer_2=tokenizer_2,
        vae=seeded(SEED + 2, lambda: AutoencoderKL(**VAE_CONFIG).eval()),
        transformer=seeded(SEED + 3, lambda: bf16(FluxTransformer2DModel(**TRANSFORMER_CONFIG))),
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)


def build_tiny_flux(*, cache_dir: str | Path | None = None) -> Path:
    """Return the directory of the tiny FLUX.1-dev pipeline, building it on first use (cached by
    content, written atomically; ``cache_dir`` overrides the cache root)."""
    spec = {
        "builder": _BUILDER_VERSION,
        "seed": SEED,
        "transformer": TRANSFORMER_CONFIG,
        "clip": CLIP_CONFIG,
        "t5": T5_CONFIG,
        "vae": VAE_CONFIG,
        "scheduler": SCHEDULER_CONFIG,
    }
    final = cache_root("tiny_flux", cache_dir) / f"flux1_dev_{content_key(spec)}"
    return cached_build(final, _build_into)
