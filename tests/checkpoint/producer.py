"""Real msModelSlim exports of a tiny two-expert Wan2.2 model, built on CPU in seconds.

The BF16 original is a diffusers pipeline directory (``WanTransformer3DModel`` per expert plus small
stand-in components). msModelSlim quantizes it through
:mod:`vllm_omni_mxfp4_tiny.msmodelslim_export` (msModelSlim's own Smooth, quantizer and savers on
the original Wan module tree); this module only fixes the tiny config, builds the pipeline and binds
the exporter to that config. The exporter's diffusers -> original renames are regular expressions
written independently of ``vllm_omni_mxfp4.models.names``, so a wrong table there cannot be
mirrored here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_omni_mxfp4_tiny import msmodelslim_export as exporter
from vllm_omni_mxfp4_tiny import tiny_transformer_config
from vllm_omni_mxfp4_tiny.msmodelslim_export import (
    NON_BLOCK_EXCLUDES,
    ExpertSpec,
    LayerReference,
    all_linears,
    original_name,
)

__all__ = [
    "DIM",
    "NON_BLOCK_EXCLUDES",
    "TINY",
    "ExpertSpec",
    "LayerReference",
    "all_linears",
    "build_pipeline",
    "original_name",
    "quantize_expert",
]

# The project's tiny Wan transformer, with three blocks: the specs of conftest.py use blocks.2.
TINY = tiny_transformer_config(num_layers=3)
DIM = TINY["num_attention_heads"] * TINY["attention_head_dim"]


def build_pipeline(
    root: Path,
    *,
    transformers=("transformer", "transformer_2"),
    pipeline="WanPipeline",
    seed: int = 0,
    config: dict | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """A diffusers pipeline dir with random BF16 tiny transformers (``config``, default :data:`TINY`)
    and stand-in components."""
    from diffusers import WanTransformer3DModel

    root.mkdir(parents=True)
    states = {}
    index: dict[str, object] = {
        "_class_name": pipeline,
        "_diffusers_version": "0.40.0",
        "boundary_ratio": 0.875,
    }
    for i, folder in enumerate(transformers):
        torch.manual_seed(seed + i)
        model = WanTransformer3DModel(**(config or TINY))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.05)
        model = model.to(torch.bfloat16)
        model.save_pretrained(root / folder)
        states[folder] = {k: v.clone() for k, v in model.state_dict().items()}
        index[folder] = ["diffusers", "WanTransformer3DModel"]
    if "transformer_2" not in transformers:
        index["transformer_2"] = [None, None]
    index.update(
        vae=["diffusers", "AutoencoderKLWan"],
        text_encoder=["transformers", "UMT5EncoderModel"],
        tokenizer=["transformers", "T5TokenizerFast"],
        scheduler=["diffusers", "UniPCMultistepScheduler"],
    )
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    gen = torch.Generator().manual_seed(seed + 100)
    from safetensors.torch import save_file

    for folder, config_name, weights in (
        ("vae", "config.json", "diffusion_pytorch_model.safetensors"),
        ("text_encoder", "config.json", "model.safetensors"),
    ):
        (root / folder).mkdir()
        (root / folder / config_name).write_text(json.dumps({"_class_name": folder, "seed": seed}))
        save_file({"w": torch.randn(64, 32, generator=gen)}, str(root / folder / weights))
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer.json").write_text(json.dumps({"vocab": {"a": 0, "cat": 1}}))
    (root / "tokenizer" / "spiece.model").write_bytes(bytes(range(256)) * 3)
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": "UniPCMultistepScheduler"})
    )
    (root / "README.md").write_text("tiny Wan2.2 test pipeline\n")
    return states


def quantize_expert(
    diffusers_state: dict[str, torch.Tensor], save_dir: Path, spec: ExpertSpec, seed: int = 0
) -> dict[str, LayerReference]:
    """Run msModelSlim on one tiny expert; returns references by ORIGINAL layer name."""
    return exporter.quantize_expert(diffusers_state, TINY, save_dir, spec, seed=seed)
