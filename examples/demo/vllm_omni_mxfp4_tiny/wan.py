"""The embedded default model: tiny random Wan2.2 text-to-video pipelines built locally.

Tests, the demo and the CPU platform's self-checks need a real diffusers ``WanPipeline`` directory
that vLLM-Omni loads through its own Wan2.2 code (``Omni(model=...)``, ``vllm serve ... --omni``),
but small enough to generate a few frames on two CPU cores in seconds. :func:`build_tiny_wan` builds
one from configs with random weights drawn from a fixed seed (no hub download: the tokenizer is a
word-level ``tokenizers`` model made in memory), and caches it on disk by content.

Layout of the returned directory (what ``WanPipeline.save_pretrained`` writes)::

    model_index.json   scheduler/   tokenizer/   text_encoder/   vae/
    transformer/       transformer_2/ (experts=2 only; model_index then carries boundary_ratio)

The transformer's block Linears have K and N in {512, 1024}: multiples of the MX block (32) and of
the DualScale coarse block (512), so both ``mxfp4`` and ``mxfp4_dualscale`` apply to every one.
Transformers are stored in BF16 like the released Wan2.2 checkpoints; text encoder and VAE in FP32.

:func:`build_tiny_wan_variant` builds the other Wan2.2 layouts from the same parts
(:data:`VARIANTS`): ``i2v`` (I2V-A14B, ``WanImageToVideoPipeline``) and ``ti2v`` (TI2V-5B, the
48-channel VAE and ``expand_timesteps``).

Cache: ``tiny_wan/`` under :func:`vllm_omni_mxfp4.envs.cache_dir` (``$VLLM_OMNI_MXFP4_CACHE``, default
``~/.cache/vllm-omni-mxfp4``), one directory per content key (the builder's configs, seed, expert count, and the torch / diffusers /
transformers / tokenizers versions). A build goes to a staging directory that is renamed into place
in one step (:mod:`.cache`), so concurrent or interrupted builds never leave a half-written model
behind.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from .cache import cache_root, cached_build, content_key
from .parts import bf16, seeded

SEED = 0
"""Seed of every random weight; expert ``i`` (0-based) uses ``SEED + 1 + i``."""

BOUNDARY_RATIO = 0.875
"""Wan2.2 T2V A14B's switch point from the high-noise to the low-noise expert."""

# Bump when the build procedure changes in a way the configs below do not capture.
_BUILDER_VERSION = 1

TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 4,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 1024,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 32,
}
"""diffusers ``WanTransformer3DModel`` config of each expert (inner dim 4 x 128 = 512): the one tiny-Wan
transformer config of the project; fixtures that need a variant take :func:`tiny_transformer_config`
with overrides."""

TEXT_ENCODER_CONFIG: dict[str, Any] = {
    "vocab_size": 64,
    "d_model": TRANSFORMER_CONFIG["text_dim"],
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
}
"""transformers ``UMT5Config`` of the text encoder (``d_model`` equals the transformer's text_dim)."""

VAE_CONFIG: dict[str, Any] = {
    "base_dim": 8,
    "z_dim": TRANSFORMER_CONFIG["in_channels"],
    "dim_mult": [1, 1, 1, 1],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
}
"""diffusers ``AutoencoderKLWan`` config: 8x spatial, 4x temporal compression like the real VAE."""

SCHEDULER_CONFIG: dict[str, Any] = {"shift": 3.0}
"""diffusers ``FlowMatchEulerDiscreteScheduler`` config (vLLM-Omni's Wan2.2 builds its own scheduler)."""

VOCABULARY: tuple[str, ...] = (
    "<pad>",
    "</s>",
    "<unk>",
    "a",
    "an",
    "the",
    "of",
    "on",
    "in",
    "at",
    "with",
    "and",
    "is",
    "are",
    "walking",
    "running",
    "flying",
    "sitting",
    "cat",
    "dog",
    "bird",
    "fish",
    "horse",
    "person",
    "car",
    "boat",
    "tree",
    "flower",
    "grass",
    "beach",
    "sea",
    "sky",
    "city",
    "street",
    "red",
    "blue",
    "green",
    "yellow",
    "white",
    "black",
    "video",
    "photo",
    "slowly",
    "quickly",
    "bright",
    "dark",
    "blurry",
    "low",
    "quality",
)
"""Word-level vocabulary of the offline tokenizer; other words map to ``<unk>``."""

TOKENIZER_MAX_LENGTH = 512


def tiny_transformer_config(**overrides: Any) -> dict[str, Any]:
    """A copy of the diffusers transformer config (as written to ``transformer/config.json``).

    ``overrides`` replace or add diffusers ``WanTransformer3DModel`` keys, e.g. ``num_layers=3`` or
    the image-conditioned ``image_dim``; the pipeline :func:`build_tiny_wan` builds uses none.
    """
    return {**copy.deepcopy(TRANSFORMER_CONFIG), **overrides}


def omni_transformer_kwargs() -> dict[str, Any]:
    """Keyword arguments for vLLM-Omni's ``WanTransformer3DModel`` built from the tiny config.

    vLLM-Omni's constructor takes the diffusers config minus ``qk_norm`` (it always uses RMS norm
    across heads) and wants ``patch_size`` as a tuple.
    """
    kwargs = tiny_transformer_config()
    kwargs.pop("qk_norm")
    kwargs["patch_size"] = tuple(kwargs["patch_size"])
    return kwargs


def _content_key(experts: int) -> str:
    return content_key(
        {
            "builder": _BUILDER_VERSION,
            "experts": experts,
            "seed": SEED,
            "boundary_ratio": BOUNDARY_RATIO if experts == 2 else None,
            "transformer": TRANSFORMER_CONFIG,
            "text_encoder": TEXT_ENCODER_CONFIG,
            "vae": VAE_CONFIG,
            "scheduler": SCHEDULER_CONFIG,
            "vocabulary": VOCABULARY,
            "tokenizer_max_length": TOKENIZER_MAX_LENGTH,
        }
    )


def _experts(count: int, config: dict[str, Any]) -> list[Any]:
    """``count`` seeded diffusers Wan transformers (expert ``i`` seeded ``SEED + 1 + i``), stored in BF16."""
    from diffusers import WanTransformer3DModel

    return [seeded(SEED + 1 + i, lambda: bf16(WanTransformer3DModel(**config))) for i in range(count)]


def _text_and_vae(vae_config: dict[str, Any]) -> dict[str, Any]:
    """The pipeline's tokenizer, text encoder and VAE (seeded ``SEED``), as ``WanPipeline`` kwargs."""
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        vae = AutoencoderKLWan(**copy.deepcopy(vae_config)).eval()
        text_encoder = UMT5EncoderModel(UMT5Config(**TEXT_ENCODER_CONFIG)).eval()
    word_level = Tokenizer(
        models.WordLevel(vocab={word: i for i, word in enumerate(VOCABULARY)}, unk_token="<unk>")
    )
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=TOKENIZER_MAX_LENGTH,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    return {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, "scheduler": scheduler}


def _build_into(out_dir: Path, experts: int) -> None:
    """Build the pipeline with seeded random weights and ``save_pretrained`` it into ``out_dir``."""
    from diffusers import WanPipeline

    transformers_ = _experts(experts, tiny_transformer_config())
    pipeline = WanPipeline(
        **_text_and_vae(VAE_CONFIG),
        transformer=transformers_[0],
        transformer_2=transformers_[1] if experts == 2 else None,
        boundary_ratio=BOUNDARY_RATIO if experts == 2 else None,
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)


def build_tiny_wan(experts: int = 2, *, cache_dir: str | Path | None = None) -> Path:
    """Return the directory of the tiny Wan2.2 T2V pipeline, building it on first use.

    ``experts=2`` is the Wan2.2 A14B layout (``transformer`` for high noise, ``transformer_2`` for
    low noise, ``boundary_ratio`` 0.875); ``experts=1`` a single-transformer pipeline.
    ``cache_dir`` overrides the cache root (:func:`vllm_omni_mxfp4.envs.cache_dir`). Repeated calls with the same
    configs and library versions return the same directory without rebuilding.
    """
    if experts not in (1, 2):
        raise ValueError(f"build_tiny_wan: experts must be 1 or 2, got {experts!r}")
    final = cache_root("tiny_wan", cache_dir) / f"wan22_t2v_{experts}e_{_content_key(experts)}"
    # _build_into is looked up when the build runs (tests replace it).
    return cached_build(final, lambda staging: _build_into(staging, experts))


I2V_BOUNDARY_RATIO = 0.9
"""Wan2.2 I2V A14B's switch point from the high-noise to the low-noise expert."""

TI2V_VAE_CONFIG: dict[str, Any] = {
    **VAE_CONFIG,
    "z_dim": 48,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "latents_mean": [0.0] * 48,
    "latents_std": [1.0] * 48,
}
"""The Wan2.2 VAE of TI2V-5B, tiny: 48 latent channels, 2x2 pixel patches, 16x spatial compression."""

VARIANTS: dict[str, dict[str, Any]] = {
    "i2v": {
        "pipeline": "WanImageToVideoPipeline",
        "experts": 2,
        # the latent (16) + the first-frame mask (4) + the encoded image (16), as I2V-A14B
        "transformer": {"in_channels": 36},
        "vae": VAE_CONFIG,
        "index": {"boundary_ratio": I2V_BOUNDARY_RATIO},
    },
    "ti2v": {
        "pipeline": "WanPipeline",
        "experts": 1,
        "transformer": {"in_channels": 48, "out_channels": 48},
        "vae": TI2V_VAE_CONFIG,
        "index": {"expand_timesteps": True},
    },
}
"""The other Wan2.2 layouts: ``i2v`` is I2V-A14B (two experts, image latents concatenated to the
noise, no CLIP image encoder), ``ti2v`` is TI2V-5B (one transformer, the 48-channel Wan2.2 VAE,
``expand_timesteps``: per-token timesteps so a first frame can be given as a clean latent)."""


def _build_variant_into(out_dir: Path, variant: str) -> None:
    import diffusers

    spec = VARIANTS[variant]
    transformers_ = _experts(spec["experts"], tiny_transformer_config(**spec["transformer"]))
    pipeline = getattr(diffusers, spec["pipeline"])(
        **_text_and_vae(spec["vae"]),
        transformer=transformers_[0],
        transformer_2=transformers_[1] if spec["experts"] == 2 else None,
        **spec["index"],
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)


def build_tiny_wan_variant(variant: str, *, cache_dir: str | Path | None = None) -> Path:
    """Return the directory of the tiny Wan2.2 ``variant`` pipeline (a key of :data:`VARIANTS`),
    building it on first use; cached and written like :func:`build_tiny_wan`'s."""
    if variant not in VARIANTS:
        raise ValueError(
            f"build_tiny_wan_variant: unknown variant {variant!r}; choose from {sorted(VARIANTS)}"
        )
    spec = {
        "builder": _BUILDER_VERSION,
        "variant": VARIANTS[variant],
        "seed": SEED,
        "transformer": TRANSFORMER_CONFIG,
        "text_encoder": TEXT_ENCODER_CONFIG,
        "scheduler": SCHEDULER_CONFIG,
        "vocabulary": VOCABULARY,
        "tokenizer_max_length": TOKENIZER_MAX_LENGTH,
    }
    final = cache_root("tiny_wan", cache_dir) / f"wan22_{variant}_{content_key(spec)}"
    return cached_build(final, lambda staging: _build_variant_into(staging, variant))
