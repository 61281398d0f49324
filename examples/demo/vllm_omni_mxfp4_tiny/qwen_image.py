"""Tiny random Qwen-Image text-to-image pipeline, as vLLM-Omni's ``QwenImagePipeline`` loads it.

Layout (what diffusers' ``QwenImagePipeline.save_pretrained`` writes)::

    model_index.json  scheduler/  tokenizer/ (Qwen2Tokenizer)
    text_encoder/ (Qwen2_5_VLForConditionalGeneration; the pipeline drops its vision tower)
    vae/ (AutoencoderKLQwenImage: 16 latent channels, 8x)  transformer/

The pipeline wraps the prompt in a chat template and drops its first 34 tokens; the byte-level
tokenizer (:func:`.parts.qwen2_tokenizer`) makes one token per byte, so plenty remain. The
transformer's ``joint_attention_dim`` is the text encoder's hidden size, as in the released model,
and its block Linears have K and N multiples of 512 (inner dim 4 x 128). Cached under
``tiny_qwen_image/`` (:mod:`.cache`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cache import cache_root, cached_build, content_key
from .parts import bf16, qwen2_tokenizer, seeded, vocab_size

SEED = 0
_BUILDER_VERSION = 1

TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
}
"""Qwen2.5-VL language model (head dim 16: the M-RoPE sections cover its 8 frequency pairs)."""

VISION_CONFIG: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": TEXT_CONFIG["hidden_size"],
    "fullatt_block_indexes": [0],
}
"""Qwen2.5-VL vision tower (saved with the encoder, unused by text-to-image)."""

TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 128,
    "num_attention_heads": 4,
    "joint_attention_dim": TEXT_CONFIG["hidden_size"],
    "axes_dims_rope": [16, 56, 56],
}
"""diffusers ``QwenImageTransformer2DModel`` config (2 dual-stream blocks)."""

VAE_CONFIG: dict[str, Any] = {
    "base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 1, 1, 1],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
}
"""diffusers ``AutoencoderKLQwenImage`` config: 16 latent channels, 8x spatial compression."""

SCHEDULER_CONFIG: dict[str, Any] = {
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}
"""diffusers ``FlowMatchEulerDiscreteScheduler`` config of Qwen-Image."""

TOKENIZER_MAX_LENGTH = 1024


def _text_encoder(tokenizer: Any) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = Qwen2_5_VLConfig(
        text_config={**TEXT_CONFIG, **ids, "vocab_size": vocab_size(tokenizer)},
        vision_config=VISION_CONFIG,
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        **ids,
    )
    return bf16(Qwen2_5_VLForConditionalGeneration(config))


def _build_into(out_dir: Path) -> None:
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    tokenizer = qwen2_tokenizer(TOKENIZER_MAX_LENGTH)
    pipeline = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=seeded(SEED, lambda: AutoencoderKLQwenImage(**VAE_CONFIG).eval()),
        text_encoder=seeded(SEED + 1, lambda: _text_encoder(tokenizer)),
        tokenizer=tokenizer,
        transformer=seeded(SEED + 2, lambda: bf16(QwenImageTransformer2DModel(**TRANSFORMER_CONFIG))),
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)


def build_tiny_qwen_image(*, cache_dir: str | Path | None = None) -> Path:
    """Return the directory of the tiny Qwen-Image pipeline, building it on first use (cached by
    content, written atomically; ``cache_dir`` overrides the cache root)."""
    spec = {
        "builder": _BUILDER_VERSION,
        "seed": SEED,
        "transformer": TRANSFORMER_CONFIG,
        "text": TEXT_CONFIG,
        "vision": VISION_CONFIG,
        "vae": VAE_CONFIG,
        "scheduler": SCHEDULER_CONFIG,
        "tokenizer_max_length": TOKENIZER_MAX_LENGTH,
    }
    final = cache_root("tiny_qwen_image", cache_dir) / f"qwen_image_{content_key(spec)}"
    return cached_build(final, _build_into)
