"""The demo's offline step: an msModelSlim export of the model, merged into a diffusers checkpoint.

Without an export of its own (the tiny models), the demo makes one with msModelSlim on the CPU
(:func:`vllm_omni_mxfp4_tiny.msmodelslim_export.export_pipeline`: its own Smooth,
W4A4_MXFP4_DUALSCALE quantizer and MindIE saver; some layers stay FLOAT, every quantized one gets a
Smooth factor). For a trained model the Smooth factors are calibrated as ``msmodelslim quant``
calibrates them: on the activations of real generations (:func:`calibration_maxima`: training
prompts and a training seed, never an evaluation one). Synthetic statistics cost the trained tiny
Wan2.2 9.5 dB against BF16 (19.4 dB against 28.9 dB calibrated); the random-weight model keeps
them, its outputs having nothing to calibrate on. The merge is the runtime package's
:func:`vllm_omni_mxfp4.checkpoint.merge`, what ``vllm-omni-mxfp4 merge`` runs.

The recipe modes run one of msModelSlim's shipped Wan2.2 recipes unedited on the model
(:mod:`vllm_omni_mxfp4_tiny.msmodelslim_recipes`, cached by content: a later demo reuses the
export) and merge it with the W8A8 MXFP8 layers kept. w4a4f8's ``linear_quant`` steps are w4a4f4's
(its weight files are byte-identical; ``tests/checkpoint/test_recipes.py``), and the FA3 records that
tell them apart are left out of a merged checkpoint, so both modes run the one w4a4f4 checkpoint
(:data:`SAME_CHECKPOINT`): msModelSlim runs once.

The ``nvfp4`` mode serves an NVFP4 copy of the model that compressed-tensors packs
(:func:`nvfp4_checkpoint`, the format NVIDIA's tools publish) with ``quantization="mxfp4"``: the
package requantizes it to MXFP4 while it loads.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_omni_mxfp4.checkpoint import merge

#: The calibration set of a trained model: CALIBRATION_PROMPTS training prompts (sample_prompts
#: seed CALIBRATION_SAMPLE) with CALIBRATION_SEEDS, seeds of the training range, below TRAINING_SEEDS.
CALIBRATION_PROMPTS, CALIBRATION_SAMPLE, CALIBRATION_SEEDS = 16, 7, (0,)


def calibration_maxima(model: Path) -> dict[str, dict[str, Any]]:
    """The trained tiny Wan2.2 ``model``'s block-Linear input maxima over its calibration set, generated
    with the task's defaults (:mod:`vllm_omni_mxfp4_tiny.trained_wan`)."""
    from vllm_omni_mxfp4_tiny import trained_wan
    from vllm_omni_mxfp4_tiny.calibration import activation_maxima
    from vllm_omni_mxfp4_tiny.task import TRAINING_SEEDS, sample_prompts, video_prompts

    assert all(seed < TRAINING_SEEDS for seed in CALIBRATION_SEEDS)
    prompts = sample_prompts(video_prompts(held_out=False), CALIBRATION_PROMPTS, CALIBRATION_SAMPLE)
    return activation_maxima(
        model,
        [p.text for p in prompts],
        CALIBRATION_SEEDS,
        height=trained_wan.HEIGHT,
        width=trained_wan.WIDTH,
        num_frames=trained_wan.NUM_FRAMES,
        steps=trained_wan.EVAL_STEPS,
        guidance_scale=trained_wan.EVAL_GUIDANCE,
        guidance_scale_2=trained_wan.EVAL_GUIDANCE_2,
    )


def export(model: Path, out: Path, say: Callable[[str], None], *, calibrate: bool) -> Path:
    """A fresh msModelSlim export of ``model`` under ``out``; ``calibrate``: Smooth factors from
    :func:`calibration_maxima` (a trained model), else synthetic ones."""
    from vllm_omni_mxfp4_tiny.msmodelslim_export import export_pipeline

    quant_path = out / "msmodelslim-export"
    if quant_path.exists():
        shutil.rmtree(quant_path)
    start = time.perf_counter()
    maxima = None
    if calibrate:
        say(
            f"msModelSlim: calibrating Smooth on {CALIBRATION_PROMPTS} training prompts x "
            f"{len(CALIBRATION_SEEDS)} training seed(s)"
        )
        maxima = calibration_maxima(model)
    say("msModelSlim: quantizing the experts (W4A4_MXFP4_DUALSCALE with Smooth; some layers stay FLOAT)")
    references = export_pipeline(model, quant_path, maxima=maxima)
    counts = ", ".join(f"{name}: {len(refs)} Linears" for name, refs in references.items())
    say(f"msModelSlim: export written to {quant_path} ({counts}) in {time.perf_counter() - start:.1f} s")
    return quant_path


def offline_checkpoint(
    model: Path, quant_path: Path | None, out: Path, say: Callable[[str], None], *, calibrate: bool = False
) -> Path:
    """The merged offline checkpoint under ``out``: exports with msModelSlim first when ``quant_path`` is
    None (``calibrate``: see :func:`export`)."""
    if quant_path is None:
        quant_path = export(model, out, say, calibrate=calibrate)
    merged = out / "merged-mxfp4-dualscale"
    start = time.perf_counter()
    report = merge("auto", model, quant_path, merged, overwrite=True, non_block_quantized="original")
    for t in report.transformers:
        say(
            f"merge: {t.name}: {t.quant_method}, {t.layers_quantized} layers quantized "
            f"({t.smooth_layers} with Smooth), {t.layers_bf16} kept BF16"
        )
        for warning in t.warnings:
            say(f"merge: {t.name}: warning: {warning}")
    say(f"merge: checkpoint written to {merged} in {time.perf_counter() - start:.1f} s")
    return merged


#: recipe -> the recipe whose merged checkpoint it shares (same Linears; FA3 is not merged).
SAME_CHECKPOINT = {"w4a4f8": "w4a4f4"}


def recipe_checkpoint(model: Path, recipe: str, out: Path, say: Callable[[str], None]) -> Path:
    """``model`` quantized with the msModelSlim Wan2.2 recipe ``recipe`` (one it ships, or this package's
    svd_res recipe) and merged under ``out``."""
    from vllm_omni_mxfp4_tiny.msmodelslim_recipes import cached_recipe_export, recipe_path

    start = time.perf_counter()
    say(f"msModelSlim: recipe {recipe_path(recipe).name} (cached after its first run)")
    quant_path, _ = cached_recipe_export(recipe, model)
    say(f"msModelSlim: export {quant_path} ready in {time.perf_counter() - start:.1f} s")
    merged = out / f"merged-{recipe}"
    report = merge("auto", model, quant_path, merged, overwrite=True, mxfp8_layers="keep")
    for t in report.transformers:
        pairs = (
            f"; {len(t.low_rank_layers)} runtime Linears keep a low-rank pair" if t.low_rank_layers else ""
        )
        say(
            f"merge {recipe}: {t.name}: {t.layers_quantized} Linears quantized, {t.layers_bf16} kept BF16; "
            f"mxfp8_layers lists {len(t.mxfp8_layers)} runtime Linears{pairs}; FA3 on {len(t.fa3_attention)} "
            "attention layers and the online Q/K rotation left out (attention runs BF16)"
        )
    return merged


def nvfp4_checkpoint(model: Path, out: Path, say: Callable[[str], None]) -> Path:
    """An NVFP4 copy of ``model`` under ``out``, its experts' block Linears packed by compressed-tensors
    (:func:`vllm_omni_mxfp4_tiny.nvfp4_source.cached_nvfp4_pipeline`)."""
    from vllm_omni_mxfp4_tiny.nvfp4_source import cached_nvfp4_pipeline

    target = out / "nvfp4-compressed-tensors"
    if target.exists():
        shutil.rmtree(target)
    start = time.perf_counter()
    shutil.copytree(cached_nvfp4_pipeline(model), target)
    say(
        f"NVFP4: compressed-tensors packed the experts' block Linears into {target} in "
        f"{time.perf_counter() - start:.1f} s (cached after its first run)"
    )
    return target
