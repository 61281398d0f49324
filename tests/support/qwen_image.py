"""A tiny Qwen-Image-Edit-2509 pipeline and msModelSlim's shipped MXFP4 recipe run on it, on the CPU.

:func:`build_pipeline` writes a diffusers pipeline directory (``QwenImageEditPlusPipeline``) whose
transformer is diffusers' ``QwenImageTransformer2DModel`` with random BF16 weights, plus small
stand-in components (the merge copies them byte for byte; nothing here loads them).

:func:`run_recipe` runs ``lab_practice/qwen_image_edit/qwen-image-edit-w4a4f4-mxfp.yaml`` unedited
through msModelSlim's own service (``MultimodalSDModelslimV1QuantService.quant_process``: argument
parsing, ``init_model``, ``LayerWiseRunner`` with the recipe's processors, the ``mindie_format``
saver) with the real ``QwenImageEditModelAdapter``; its runner offloads finished blocks to the CPU
instead of the meta device, so that the quantized model stays in memory as the reference. One adapter
step is replaced, the narrowest
that lets it run here: ``load_pipeline``. The original imports ``qwenimage_edit`` (the
Qwen-Image-Edit-2509 repository's code, not installed) and loads the whole pipeline (text encoder,
VAE, processor), which a data-free recipe never uses; the replacement loads only the transformer,
from the same ``transformer/`` folder with the same dtype, with diffusers' class.

:func:`reference_forward` runs msModelSlim's in-memory quantized transformer. msModelSlim's FA3 step
replaces each block's ``forward`` by one that applies ``q_rot``/``k_rot`` and FA3 to the joint Q/K/V;
on diffusers 0.40 that replacement does not run (it rejects the ``modulate_index`` argument), and
without MindIE-SD its fallback attention reads the heads axis as the sequence axis. The reference
therefore drops that instance ``forward`` (diffusers' own block forward runs, with BF16 attention):
the rotation is an exact no-op there (applied to Q and K after RoPE) and attention stays BF16 in
vLLM-Omni too, so every quantized Linear is msModelSlim's deployed fake-quant module, unchanged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from . import msmodelslim_sd

RECIPE = "qwen_image_edit/qwen-image-edit-w4a4f4-mxfp.yaml"
MODEL_TYPE = "Qwen-Image-Edit-2509"
PIPELINE = "QwenImageEditPlusPipeline"
#: Two blocks, 4 heads of 128 (dim 512, FFN 2048): DualScale's 512-wide coarse blocks fit every K.
TINY = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=2,
    attention_head_dim=128,
    num_attention_heads=4,
    joint_attention_dim=64,
    axes_dims_rope=(16, 56, 56),
)


def recipe_path() -> Path:
    import msmodelslim

    return Path(os.path.dirname(msmodelslim.__file__)) / "lab_practice" / RECIPE


def build_pipeline(root: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A diffusers Qwen-Image-Edit-2509 pipeline directory with a tiny random BF16 transformer."""
    from diffusers import QwenImageTransformer2DModel
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(**TINY)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if "norm" in name and name.endswith("weight") else 0.05
            p.copy_(1 + 0.1 * torch.randn_like(p) if scale == 1.0 else torch.randn_like(p) * scale)
    model = model.to(torch.bfloat16)
    model.save_pretrained(root / "transformer")
    index = {
        "_class_name": PIPELINE,
        "_diffusers_version": "0.40.0",
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "processor": ["transformers", "Qwen2VLProcessor"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    gen = torch.Generator().manual_seed(seed + 100)
    for folder, weights in (
        ("vae", "diffusion_pytorch_model.safetensors"),
        ("text_encoder", "model.safetensors"),
    ):
        (root / folder).mkdir()
        (root / folder / "config.json").write_text(json.dumps({"_class_name": folder, "seed": seed}))
        save_file({"w": torch.randn(64, 32, generator=gen)}, str(root / folder / weights))
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": "FlowMatchEulerDiscreteScheduler"})
    )
    return {k: v.clone() for k, v in model.state_dict().items()}


def run_recipe(original: Path, save_path: Path) -> torch.nn.Module:
    """msModelSlim's shipped Qwen-Image-Edit recipe on ``original``, saved to ``save_path`` (created);
    returns msModelSlim's in-memory quantized transformer."""
    import yaml
    from diffusers import QwenImageTransformer2DModel
    from msmodelslim.model.qwen_image_edit.model_adapter import QwenImageEditModelAdapter

    adapter = QwenImageEditModelAdapter(MODEL_TYPE, original)

    def load_pipeline() -> None:  # the adapter's _load_pipeline without the repository import and pipeline
        adapter.transformer = QwenImageTransformer2DModel.from_pretrained(
            str(original / "transformer"), torch_dtype=torch.bfloat16, device_map=None, low_cpu_mem_usage=True
        )

    adapter.load_pipeline = load_pipeline
    msmodelslim_sd.run_service(yaml.safe_load(recipe_path().read_text()), adapter, save_path)
    return adapter.transformer


def quantized_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """msModelSlim's deployed DualScale fake-quant Linears, by module name (diffusers names)."""
    from msmodelslim.ir import W4A4MXDynamicDualScaleFakeQuantLinear

    return {n: m for n, m in model.named_modules() if isinstance(m, W4A4MXDynamicDualScaleFakeQuantLinear)}


def inputs(engine: bool = False) -> dict:
    """One transformer call's inputs (bf16): a 4x4 latent of 16 patches, 8 text tokens; ``engine``:
    for vLLM-Omni's transformer, which also takes the text lengths (diffusers 0.40's does not)."""
    g = torch.Generator().manual_seed(7)
    found = dict(
        hidden_states=torch.randn(1, 16, TINY["in_channels"], generator=g).to(torch.bfloat16),
        encoder_hidden_states=torch.randn(1, 8, TINY["joint_attention_dim"], generator=g).to(torch.bfloat16),
        encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long),
        timestep=torch.tensor([0.5], dtype=torch.bfloat16),
        img_shapes=[[(1, 4, 4)]],
        return_dict=False,
    )
    return {**found, "txt_seq_lens": [8]} if engine else found


def reference_forward(model: torch.nn.Module) -> torch.Tensor:
    """msModelSlim's quantized transformer on :func:`inputs`, its blocks' FA3 ``forward`` dropped."""
    for module in model.modules():
        if "forward" in vars(module) and type(module).__name__ == "QwenImageTransformerBlock":
            del module.forward
    # msModelSlim's adapter runs its model under bf16 autocast (apply_quantization; CUDA's, on the
    # NPU): its fake-quant Linears compute float32 values and hand them to F.linear with a bf16 bias.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(**inputs())[0].float()


def build_engine_transformer(env, pipeline_dir: Path) -> torch.nn.Module:
    """vLLM-Omni's ``QwenImageTransformer2DModel`` built and loaded from ``pipeline_dir`` as its
    Qwen-Image pipelines do (:func:`tests.support.msmodelslim_sd.build_engine_transformer`)."""
    from vllm_omni.diffusion.models.qwen_image.qwen_image_transformer import QwenImageTransformer2DModel

    from tests.support.msmodelslim_sd import build_engine_transformer as build

    return build(env, pipeline_dir, QwenImageTransformer2DModel)


def engine_forward(env, model: torch.nn.Module) -> torch.Tensor:
    """vLLM-Omni's transformer on :func:`inputs`."""
    with env.context(), torch.no_grad():
        return model(**inputs(engine=True))[0].float()
