"""A tiny FLUX.1-dev pipeline and msModelSlim's ``flux1`` adapter run on it, on the CPU.

:func:`build_pipeline` writes a diffusers pipeline directory (``FluxPipeline``) whose transformer is
diffusers' ``FluxTransformer2DModel`` of the demo's tiny FLUX.1 config (one double-stream and one
single-stream block, 4 heads of 128: every block Linear's K is a multiple of 512) with random BF16
weights, plus small stand-in components.

:func:`run_recipe` runs an MXFP4 config of the user guide's form (:func:`.msmodelslim_sd.recipe`)
through msModelSlim's service with the real ``FLUX1ModelAdapter``. The config includes only the
Linears vLLM-Omni's ``FluxTransformer2DModel`` quantizes: the single-stream blocks' ``attn.to_q`` /
``to_k`` / ``to_v`` (fused into ``attn.to_qkv``), ``proj_mlp`` and ``proj_out``; the double-stream
blocks are built with ``safe_quant_config`` (BF16). One adapter step is replaced, the narrowest that
lets it run here: ``load_pipeline``. The original loads the whole ``FluxPipeline`` and enables
accelerate's model CPU offload (CUDA/NPU), which a data-free config never uses; the replacement loads
only the transformer, from the same ``transformer/`` folder with the same dtype, and sets the block
counts from its config as the original does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_omni_mxfp4_tiny.flux import TRANSFORMER_CONFIG

from . import msmodelslim_sd

MODEL_TYPE = "FLUX.1-dev"
PIPELINE = "FluxPipeline"
TINY = dict(TRANSFORMER_CONFIG)
#: What vLLM-Omni's Flux quantizes, in diffusers names (msModelSlim's patterns).
INCLUDE = [
    f"*single_transformer_blocks.*.{name}"
    for name in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")
]
MODEL_CONFIG = {"prompt": "a tiny test", "height": 64, "width": 64, "num_inference_steps": 1}


def build_pipeline(root: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A diffusers FLUX.1-dev pipeline directory with a tiny random BF16 transformer."""
    from diffusers import FluxTransformer2DModel

    root.mkdir(parents=True)
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**TINY)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.05)
    model = model.to(torch.bfloat16)
    model.save_pretrained(root / "transformer")
    index = {
        "_class_name": PIPELINE,
        "_diffusers_version": "0.40.0",
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    msmodelslim_sd.stand_in_components(
        root,
        {
            "vae": "diffusion_pytorch_model.safetensors",
            "text_encoder": "model.safetensors",
            "text_encoder_2": "model.safetensors",
        },
        seed,
    )
    return {k: v.clone() for k, v in model.state_dict().items()}


def run_recipe(original: Path, save_path: Path, method: str, svd_rank: int = 0) -> torch.nn.Module:
    """msModelSlim's ``flux1`` adapter with the ``method`` config (``mxfp4`` / ``mxfp4_dualscale``) on
    ``original``, saved to ``save_path`` (created); returns msModelSlim's quantized transformer.
    ``svd_rank``: msModelSlim's ``svd_res`` step first on the same Linears, and the ascendv1 saver
    (the one that writes the low-rank pairs)."""
    from diffusers import FluxTransformer2DModel
    from msmodelslim.model.flux1.model_adapter import FLUX1ModelAdapter

    adapter = FLUX1ModelAdapter(MODEL_TYPE, original)

    def load_pipeline() -> None:  # the adapter's _load_pipeline without the pipeline and its offload
        adapter.transformer = FluxTransformer2DModel.from_pretrained(
            str(original / "transformer"), torch_dtype=torch.bfloat16, low_cpu_mem_usage=True
        )
        adapter.transformer_blocks_layers = adapter.transformer.config.num_layers
        adapter.single_transformer_blocks_layers = adapter.transformer.config.num_single_layers

    adapter.load_pipeline = load_pipeline
    config = msmodelslim_sd.recipe(method, INCLUDE, MODEL_CONFIG)
    if svd_rank:
        config["spec"]["process"].insert(0, {"type": "svd_res", "rank": svd_rank, "include": INCLUDE})
        config["spec"]["save"] = [{"type": "ascendv1_saver", "part_file_size": 0}]
    msmodelslim_sd.run_service(config, adapter, save_path)
    return adapter.transformer


def inputs() -> dict:
    """One transformer call's inputs (bf16): a 4x4 latent of 16 tokens, 8 text tokens."""
    g = torch.Generator().manual_seed(7)
    img_ids = torch.zeros(16, 3)
    img_ids[:, 1] = torch.arange(16) // 4
    img_ids[:, 2] = torch.arange(16) % 4
    return dict(
        hidden_states=torch.randn(1, 16, TINY["in_channels"], generator=g).to(torch.bfloat16),
        encoder_hidden_states=torch.randn(1, 8, TINY["joint_attention_dim"], generator=g).to(torch.bfloat16),
        pooled_projections=torch.randn(1, TINY["pooled_projection_dim"], generator=g).to(torch.bfloat16),
        timestep=torch.tensor([0.5], dtype=torch.bfloat16),
        img_ids=img_ids,
        txt_ids=torch.zeros(8, 3),
        guidance=torch.tensor([3.5], dtype=torch.bfloat16),
        return_dict=False,
    )


def reference_forward(model: torch.nn.Module) -> torch.Tensor:
    """msModelSlim's quantized transformer on :func:`inputs`, under the bf16 autocast its adapter's
    ``apply_quantization`` uses (CUDA's there; the CPU's here)."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(**inputs())[0].float()


def engine_transformer(env, pipeline_dir: Path) -> torch.nn.Module:
    """vLLM-Omni's ``FluxTransformer2DModel`` loaded from ``pipeline_dir`` (see
    :func:`.msmodelslim_sd.build_engine_transformer`)."""
    from vllm_omni.diffusion.models.flux.flux_transformer import FluxTransformer2DModel

    return msmodelslim_sd.build_engine_transformer(env, pipeline_dir, FluxTransformer2DModel)


def engine_forward(env, model: torch.nn.Module) -> torch.Tensor:
    """vLLM-Omni's transformer on :func:`inputs`."""
    with env.context(), torch.no_grad():
        return model(**inputs())[0].float()
