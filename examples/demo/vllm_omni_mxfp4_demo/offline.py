"""The demo's offline step: an msModelSlim export of the model, merged into a diffusers checkpoint.

Without an export of its own (the tiny model), the demo makes one with msModelSlim on the CPU
(:func:`vllm_omni_mxfp4_demo.tiny.msmodelslim_export.export_pipeline`: its own Smooth,
W4A4_MXFP4_DUALSCALE quantizer and MindIE saver; some layers stay FLOAT, every quantized one gets a
Smooth factor). The merge is the runtime package's :func:`vllm_omni_mxfp4.checkpoint.merge`, what
``vllm-omni-mxfp4 merge`` runs.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from vllm_omni_mxfp4.checkpoint import merge


def export(model: Path, out: Path, say: Callable[[str], None]) -> Path:
    """A fresh msModelSlim export of ``model`` under ``out``."""
    from .tiny.msmodelslim_export import export_pipeline

    quant_path = out / "msmodelslim-export"
    if quant_path.exists():
        shutil.rmtree(quant_path)
    start = time.perf_counter()
    say("msModelSlim: quantizing the experts (W4A4_MXFP4_DUALSCALE with Smooth; some layers stay FLOAT)")
    references = export_pipeline(model, quant_path)
    counts = ", ".join(f"{name}: {len(refs)} Linears" for name, refs in references.items())
    say(f"msModelSlim: export written to {quant_path} ({counts}) in {time.perf_counter() - start:.1f} s")
    return quant_path


def offline_checkpoint(model: Path, quant_path: Path | None, out: Path, say: Callable[[str], None]) -> Path:
    """The merged offline checkpoint under ``out``: exports with msModelSlim first when ``quant_path`` is None."""
    if quant_path is None:
        quant_path = export(model, out, say)
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
