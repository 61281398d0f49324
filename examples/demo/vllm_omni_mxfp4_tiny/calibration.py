"""Per-channel activation maxima of a diffusers Wan2.2 pipeline's block Linears, from real generations:
the statistics msModelSlim's Smooth calibrates on.

msModelSlim's ``msmodelslim quant`` runs the model on calibration prompts, records each Linear's
per-input-channel absolute maximum, and derives the Smooth factors from them and the weights.
:func:`activation_maxima` does that calibration run with diffusers' own pipeline (FP32, so that no
BF16 kernel of the CPU skews the statistics), every request's denoising steps and classifier-free
guidance branches included, so each expert sees the noise levels it serves. The maxima are keyed by
the ORIGINAL Wan name of each Linear (``blocks.0.self_attn.q``), the names msModelSlim's Smooth
groups use (:func:`vllm_omni_mxfp4_tiny.msmodelslim_export.original_name`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from .msmodelslim_export import original_name, pipeline_transformers

logger = logging.getLogger(__name__)


def _recorders(transformer: torch.nn.Module, maxima: dict[str, torch.Tensor]) -> list:
    handles = []
    for name, module in transformer.named_modules():
        if not (name.startswith("blocks.") and isinstance(module, torch.nn.Linear)):
            continue
        key = original_name(f"{name}.weight")[: -len(".weight")]

        def record(_module: torch.nn.Module, inputs: tuple, key: str = key) -> None:
            x = inputs[0].detach().float().abs().reshape(-1, inputs[0].shape[-1]).amax(dim=0)
            maxima[key] = x if key not in maxima else torch.maximum(maxima[key], x)

        handles.append(module.register_forward_pre_hook(record))
    return handles


@torch.no_grad()
def activation_maxima(
    pipeline_dir: str | Path,
    prompts: Sequence[str],
    seeds: Sequence[int],
    *,
    height: int,
    width: int,
    num_frames: int,
    steps: int,
    guidance_scale: float,
    guidance_scale_2: float | None = None,
    negative_prompt: str = "",
) -> dict[str, dict[str, torch.Tensor]]:
    """Each transformer folder's ``{original Linear name: per-input-channel abs max}`` over the
    generations of ``prompts`` x ``seeds`` through the diffusers pipeline at ``pipeline_dir``.

    Only the Linears of the transformer blocks are recorded (those msModelSlim smooths). A
    transformer that ran no step (a boundary that sends every step to one expert) is an error: its
    Smooth factors would have nothing to stand on."""
    from diffusers import WanPipeline

    if not prompts or not seeds:
        raise ValueError("activation_maxima: at least one prompt and one seed are needed")
    folders = pipeline_transformers(pipeline_dir)
    pipe = WanPipeline.from_pretrained(str(pipeline_dir)).to(torch.float32)
    pipe.set_progress_bar_config(disable=True)
    maxima: dict[str, dict[str, torch.Tensor]] = {folder: {} for folder in folders}
    handles = [h for folder in folders for h in _recorders(getattr(pipe, folder), maxima[folder])]
    try:
        for seed in seeds:
            pipe(
                prompt=list(prompts),
                negative_prompt=[negative_prompt] * len(prompts),
                height=height,
                width=width,
                num_frames=num_frames,
                num_inference_steps=steps,
                guidance_scale=guidance_scale,
                guidance_scale_2=guidance_scale_2,
                generator=[torch.Generator().manual_seed(seed) for _ in prompts],
                output_type="latent",
            )
    finally:
        for handle in handles:
            handle.remove()
    idle = [folder for folder in folders if not maxima[folder]]
    if idle:
        raise ValueError(
            f"activation_maxima: {idle} of {pipeline_dir} ran no denoising step with {steps} steps; "
            "use more steps or check the pipeline's boundary_ratio"
        )
    logger.info(
        "calibrated %s on %d prompts x %d seeds (%d steps)",
        ", ".join(f"{f}: {len(m)} Linears" for f, m in maxima.items()),
        len(prompts),
        len(seeds),
        steps,
    )
    return maxima
