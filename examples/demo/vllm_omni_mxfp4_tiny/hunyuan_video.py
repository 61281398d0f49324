"""Tiny random HunyuanVideo-1.5 text-to-video pipeline, as vLLM-Omni's ``HunyuanVideo15Pipeline``
loads it.

Layout (what diffusers' ``HunyuanVideo15Pipeline.save_pretrained`` writes)::

    model_index.json  scheduler/  guider/  tokenizer/ text_encoder/ (Qwen2_5_VLTextModel)
    tokenizer_2/ text_encoder_2/ (ByT5: T5 encoder over bytes, for quoted glyph text)
    vae/ (AutoencoderKLHunyuanVideo15: 32 latent channels, 16x spatial, 4x temporal)  transformer/

The pipeline takes the text encoder's third-last hidden state (so it has 3 layers) and crops the
first 108 tokens of its chat template; it always feeds a zero image embedding of 729 x 1152 (the
SigLIP width of the image-to-video variant), so the transformer keeps ``image_embed_dim`` 1152. The
transformer's ``text_embed_dim`` and ``text_embed_2_dim`` are the two encoders' widths; its block
Linears have K and N multiples of 512 (inner dim 4 x 128). Cached under ``tiny_hunyuan_video/``
(:mod:`.cache`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cache import cache_root, cached_build, content_key
from .parts import bf16, byt5_tokenizer, qwen2_tokenizer, seeded, vocab_size

SEED = 0
_BUILDER_VERSION = 1

TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
}
"""transformers ``Qwen2_5_VLTextConfig`` (the language model of Qwen2.5-VL, head dim 16)."""

BYT5_CONFIG: dict[str, Any] = {
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 1,
    "num_heads": 4,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
}
"""transformers ``T5Config`` of the ByT5 glyph encoder (vocabulary from the byte tokenizer)."""

TRANSFORMER_CONFIG: dict[str, Any] = {
    "in_channels": 65,
    "out_channels": 32,
    "num_attention_heads": 4,
    "attention_head_dim": 128,
    "num_layers": 1,
    "num_refiner_layers": 1,
    "text_embed_dim": TEXT_CONFIG["hidden_size"],
    "text_embed_2_dim": BYT5_CONFIG["d_model"],
    "image_embed_dim": 1152,
    "rope_axes_dim": [16, 56, 56],
    "task_type": "t2v",
}
"""diffusers ``HunyuanVideo15Transformer3DModel`` config: latent (32) + condition (32) + mask (1)."""

VAE_CONFIG: dict[str, Any] = {
    "latent_channels": 32,
    "block_out_channels": [8, 16, 32, 64, 64],
    "layers_per_block": 1,
}
"""diffusers ``AutoencoderKLHunyuanVideo15`` config: the released widths / 16, same compression."""

SCHEDULER_CONFIG: dict[str, Any] = {"shift": 5.0}
"""diffusers ``FlowMatchEulerDiscreteScheduler`` config (HunyuanVideo-1.5 480p's flow shift)."""

TOKENIZER_MAX_LENGTH = 1108


def _text_encoders(tokenizer: Any, tokenizer_2: Any) -> tuple[Any, Any]:
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    text = Qwen2_5_VLTextConfig(
        **TEXT_CONFIG,
        vocab_size=vocab_size(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    byt5 = T5Config(**BYT5_CONFIG, vocab_size=vocab_size(tokenizer_2), pad_token_id=0, eos_token_id=1)
    return (
        seeded(SEED + 1, lambda: bf16(Qwen2_5_VLTextModel(text))),
        seeded(SEED + 2, lambda: bf16(T5EncoderModel(byt5))),
    )


def _build_into(out_dir: Path) -> None:
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )

    tokenizer, tokenizer_2 = qwen2_tokenizer(TOKENIZER_MAX_LENGTH), byt5_tokenizer()
    text_encoder, text_encoder_2 = _text_encoders(tokenizer, tokenizer_2)
    pipeline = HunyuanVideo15Pipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=seeded(SEED + 3, lambda: bf16(HunyuanVideo15Transformer3DModel(**TRANSFORMER_CONFIG))),
        vae=seeded(SEED, lambda: AutoencoderKLHunyuanVideo15(**VAE_CONFIG).eval()),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)


def build_tiny_hunyuan_video(*, cache_dir: str | Path | None = None) -> Path:
    """Return the directory of the tiny HunyuanVideo-1.5 pipeline, building it on first use (cached
    by content, written atomically; ``cache_dir`` overrides the cache root)."""
    spec = {
        "builder": _BUILDER_VERSION,
        "seed": SEED,
        "transformer": TRANSFORMER_CONFIG,
        "text": TEXT_CONFIG,
        "byt5": BYT5_CONFIG,
        "vae": VAE_CONFIG,
        "scheduler": SCHEDULER_CONFIG,
        "tokenizer_max_length": TOKENIZER_MAX_LENGTH,
    }
    final = cache_root("tiny_hunyuan_video", cache_dir) / f"hunyuan_video_15_{content_key(spec)}"
    return cached_build(final, _build_into)
