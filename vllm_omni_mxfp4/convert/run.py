"""``convert``: an NVFP4 diffusers pipeline (or one transformer directory) -> an offline MXFP4 one.

Everything is planned and checked first (detection, names, the target's Linears: headers only), then
the output is written into a staging directory beside the target and renamed into place
(:mod:`vllm_omni_mxfp4.publish`, the merge's write loop), so a refusal, an error or an interruption
leaves no output. Each layer is requantized when the writer reaches it and freed before the next:
memory stays at one layer's result plus row-chunk temporaries.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_omni_mxfp4 import spec
from vllm_omni_mxfp4.errors import CheckpointError
from vllm_omni_mxfp4.formats.requant import REQUANT_RULES
from vllm_omni_mxfp4.publish.output import (
    ComponentOutput,
    check_output,
    component_files,
    handle_stale_staging,
    publish,
)
from vllm_omni_mxfp4.sources.nvfp4 import SourceError, detect_nvfp4

from .plan import ComponentPlan, ConvertedComponent, plan_conversion

logger = logging.getLogger(__name__)

DEFAULT_RULE = spec.REQUANT_DEFAULT_RULE
"""The default scale rule: the most accurate (never worse than floor, even or rceil on any block);
offline, the result is data to every backend, so no kernel constrains the choice."""


@dataclass
class ConvertReport:
    """The result of :func:`convert`; ``to_dict()`` is the ``--json`` output."""

    input_path: str
    output_path: str
    scale_rule: str
    dry_run: bool
    components: list[ConvertedComponent]
    copied_files: int
    copied_bytes: int
    seconds: float = 0.0
    removed_stale: list[str] = field(default_factory=list)
    stale_staging: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _nvfp4_components(pipeline: Path) -> list[str]:
    """The pipeline's component folders that hold an NVFP4 checkpoint (detection, headers only)."""
    found = []
    for sub in sorted(p for p in pipeline.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            if any(sub.glob("*.safetensors")) and detect_nvfp4(sub) is not None:
                found.append(sub.name)
        except SourceError as exc:
            raise CheckpointError(f"{sub}: {exc}") from None
    if not found:
        raise CheckpointError(
            f"{pipeline}: no component folder holds an NVFP4 checkpoint; nothing to convert"
        )
    return found


def _record_errors(plan: ComponentPlan) -> None:
    """Each requantized layer's error, known once its bytes are written, into the report."""
    for layer in plan.report.layers:
        error = plan.errors.get(layer.source) if layer.action == "mxfp4" else None
        if error is not None:
            layer.rel_rms, layer.max_abs = error.rel_rms, error.max_abs
            layer.exact_blocks, layer.total_blocks = error.exact_blocks, error.total_blocks


def _outputs(plans: list[ComponentPlan]) -> list[ComponentOutput]:
    """What :func:`~vllm_omni_mxfp4.publish.output.publish` writes for each converted component."""
    return [
        ComponentOutput(
            plan.report.name, plan.report, plan.shards, plan.config, {}, plan.extra_files,
            close=plan.reader.close, finished=functools.partial(_record_errors, plan),
        )
        for plan in plans
    ]  # fmt: skip


def convert(
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    scale_rule: str = DEFAULT_RULE,
    max_shard_size: int | None = None,
    dry_run: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
    workers: int = 1,
) -> ConvertReport:
    """Convert an NVFP4 pipeline or transformer directory into an offline MXFP4 one.

    ``input_path``: a diffusers pipeline (``model_index.json``; each NVFP4 component is converted,
    every other file copied byte for byte) or one transformer directory. ``scale_rule``: one of
    :data:`~vllm_omni_mxfp4.formats.requant.REQUANT_RULES`. ``dry_run`` plans and reports without
    computing or writing. ``workers``: threads that requantize each layer's row chunks (the caller
    runs torch with one intra-op thread then; the command line does). Raises :class:`CheckpointError`
    for anything refused; on any failure or interruption no output is left.
    """
    start = time.perf_counter()
    if scale_rule not in REQUANT_RULES:
        raise CheckpointError(f"scale rule {scale_rule!r}; expected one of {', '.join(REQUANT_RULES)}")
    if max_shard_size is not None and max_shard_size <= 0:
        raise CheckpointError(f"max shard size must be positive, got {max_shard_size}")
    source, output = Path(input_path).absolute(), Path(output_path).absolute()
    stale = handle_stale_staging(output, dry_run)
    if not source.is_dir():
        raise CheckpointError(f"input directory {source} does not exist")
    check_output(output, [source], overwrite)
    pipeline = (source / "model_index.json").is_file()
    names = _nvfp4_components(source) if pipeline else ["."]
    plans = [
        plan_conversion(source / name, name, scale_rule, max_shard_size, workers=workers) for name in names
    ]
    copies = component_files(source, set(names)) if pipeline else []
    report = ConvertReport(
        str(source), str(output), scale_rule, dry_run, [p.report for p in plans], len(copies),
        sum((source / rel).stat().st_size for rel in copies),
        removed_stale=[] if dry_run else stale, stale_staging=stale if dry_run else [],
    )  # fmt: skip
    if not dry_run:
        publish(
            source, output, copies, _outputs(plans), desc="convert", progress=progress, overwrite=overwrite
        )
        for plan in plans:
            r = plan.report
            logger.info("%s: %d mxfp4, %d bf16, %d kept, %.2f s", r.name, r.count("mxfp4"), r.count("bf16"),
                        r.count("kept"), r.seconds)  # fmt: skip
    report.seconds = round(time.perf_counter() - start, 3)
    return report
