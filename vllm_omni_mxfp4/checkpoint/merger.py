"""Merge an msModelSlim MXFP4 export into a diffusers pipeline directory (Wan2.2, Wan2.1, Qwen-Image family,
FLUX.1).

The output is the original pipeline with each quantized transformer replaced: the diffusers tensor
names, the quantized tensors (``weight``, ``weight_scale``, ``weight_dual_scale``, ``mul_scale``,
``bias``) overlaid on the BF16 original, ``quantization_config`` in ``config.json`` (so vLLM-Omni
detects the method with no flag) and a remapped ``quant_model_description.json`` for reference.
Every other file of the pipeline is copied byte for byte.

Validation runs first, for all transformers, then the output is built in a staging directory beside
the target and renamed into place at the end (:mod:`vllm_omni_mxfp4.publish`).

The names of each transformer's tensors at runtime (fused layers, Linears the model keeps in BF16,
the names ``ignored_layers`` uses) come from vLLM-Omni's own model class: a names provider
(by default :func:`vllm_omni_mxfp4.models.derive_names`, which imports vLLM-Omni) turns the
original's ``config.json`` and tensor names into plain data (:class:`~.names.ModelNames`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, read_json_object
from ..models import derive_names
from ..models.names import (
    DIFFUSERS_EXPORT_NAMES,
    WAN_EXPORT_NAMES,
    ModelNames,
    NamesProvider,
    block_spans,
    derived_model_names,
    disagreeing_blocks,
    layer_count_keys,
)
from ..publish.output import ComponentOutput, check_output, component_files, handle_stale_staging, publish
from ..safetensors_io import diffusers_archive
from .plan import (
    DESCRIPTION_NAME,
    MXFP8_POLICIES,
    NON_BLOCK_POLICIES,
    WEIGHT_LAYOUTS,
    TransformerPlan,
    TransformerReport,
    check_original_unquantized,
    original_config,
    plan_transformer,
)

logger = logging.getLogger(__name__)

AUTO = "auto"


@dataclass(frozen=True)
class TransformerSource:
    """One transformer of a model type: its diffusers folder and where msModelSlim saved it.

    ``export_subdir`` is the expert's folder inside the msModelSlim output, or ``None`` when the
    model has one transformer and msModelSlim saved it at the root of the output.
    """

    folder: str
    export_subdir: str | None

    def export_dir(self, quant: Path) -> Path:
        return quant if self.export_subdir is None else quant / self.export_subdir


@dataclass(frozen=True)
class ModelType:
    """A model msModelSlim quantizes and vLLM-Omni serves: its diffusers pipeline classes
    (``model_index.json`` ``_class_name``), its transformers' class, how the export names tensors
    (:data:`~.names.EXPORT_NAMINGS`) and where each transformer is. ``index_flags`` tell apart types
    that share a pipeline class and transformers: ``model_index.json`` keys whose truth value must be
    the one given (a missing key is false), e.g. Wan2.2-TI2V-5B's ``expand_timesteps`` against Wan2.1."""

    pipelines: tuple[str, ...]
    transformer_class: str
    export_names: str
    transformers: tuple[TransformerSource, ...]
    index_flags: tuple[tuple[str, bool], ...] = ()

    def describes(self, index: Mapping[str, Any], listed: list[str]) -> bool:
        """Whether ``model_index.json`` (``index``, listing the transformers ``listed``) is this type's."""
        return (
            index.get("_class_name") in self.pipelines
            and listed == [source.folder for source in self.transformers]
            and all(bool(index.get(key)) == value for key, value in self.index_flags)
        )


_ONE = (TransformerSource("transformer", None),)
_EXPERTS = (
    TransformerSource("transformer", "high_noise_model"),
    TransformerSource("transformer_2", "low_noise_model"),
)
_WAN = "WanTransformer3DModel"
_QWEN = "QwenImageTransformer2DModel"
_FLUX = "FluxTransformer2DModel"
#: One-transformer WanPipelines: Wan2.2-TI2V-5B's model_index.json sets expand_timesteps, Wan2.1's does not.
_TI2V = (("expand_timesteps", True),)
_NOT_TI2V = (("expand_timesteps", False),)
#: model type (msModelSlim's ``--model_type`` spelling where it has one) -> what the merge needs.
MODEL_TYPES: dict[str, ModelType] = {
    "Wan2.2-T2V-A14B": ModelType(("WanPipeline",), _WAN, WAN_EXPORT_NAMES, _EXPERTS),
    "Wan2.2-I2V-A14B": ModelType(("WanImageToVideoPipeline",), _WAN, WAN_EXPORT_NAMES, _EXPERTS),
    "Wan2.2-TI2V-5B": ModelType(("WanPipeline",), _WAN, WAN_EXPORT_NAMES, _ONE, _TI2V),
    # msModelSlim's wan2_1 adapter (Wan2.1 T2V, 1.3B and 14B): one transformer, saved at the export root.
    "Wan2.1-T2V": ModelType(("WanPipeline",), _WAN, WAN_EXPORT_NAMES, _ONE, _NOT_TI2V),
    "Qwen-Image": ModelType(("QwenImagePipeline",), _QWEN, DIFFUSERS_EXPORT_NAMES, _ONE),
    "Qwen-Image-Edit": ModelType(("QwenImageEditPipeline",), _QWEN, DIFFUSERS_EXPORT_NAMES, _ONE),
    "Qwen-Image-Edit-2509": ModelType(("QwenImageEditPlusPipeline",), _QWEN, DIFFUSERS_EXPORT_NAMES, _ONE),
    "FLUX.1-dev": ModelType(("FluxPipeline",), _FLUX, DIFFUSERS_EXPORT_NAMES, _ONE),
}
#: msModelSlim model types whose exports vLLM-Omni cannot serve -> why; the merge refuses them by name.
UNSERVED_MODEL_TYPES: dict[str, str] = {
    "HunyuanVideo": (
        "msModelSlim's hunyuan_video adapter quantizes HunyuanVideo 1.0 (the hyvideo repository's "
        "MMDoubleStreamBlock/MMSingleStreamBlock transformer, loaded from hunyuan-video-t2v-720p), which "
        "vLLM-Omni does not serve; vLLM-Omni serves HunyuanVideo-1.5 (HunyuanVideo15Transformer3DModel), "
        "another architecture that msModelSlim has no adapter for: quantize HunyuanVideo-1.5 online "
        "(--quantization mxfp4 or mxfp4_dualscale) instead"
    ),
}
#: diffusers pipeline classes of those models (``model_index.json`` ``_class_name``) -> model type.
_UNSERVED_PIPELINES = {"HunyuanVideoPipeline": "HunyuanVideo"}


@dataclass
class MergeReport:
    """The result of :func:`merge`; ``to_dict()`` is the ``--json`` output."""

    model_type: str
    original_model: str
    quant_path: str
    output_path: str
    weight_layout: str
    dry_run: bool
    transformers: list[TransformerReport]
    copied_files: int
    copied_bytes: int
    seconds: float
    #: Staging directories of killed merges that this run removed (a dry run removes none) ...
    removed_stale: list[str] = field(default_factory=list)
    #: ... and those a dry run found (a later merge removes them).
    stale_staging: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _read_model_index(original: Path) -> dict:
    return read_json_object(
        original / "model_index.json", if_missing="--original-model must be a diffusers pipeline directory"
    )


def _listed_transformers(index: dict) -> list[str]:
    names = []
    for key in ("transformer", "transformer_2"):
        value = index.get(key)
        if isinstance(value, list) and value and value[0] is not None:
            names.append(key)
    return names


def _auto_model_type(index: dict, listed: list[str], where: Path) -> str:
    """The model type whose pipeline class and transformers ``model_index.json`` names."""
    pipeline = index.get("_class_name")
    for name, model in MODEL_TYPES.items():
        if model.describes(index, listed):
            return name
    if pipeline in _UNSERVED_PIPELINES:
        name = _UNSERVED_PIPELINES[pipeline]
        raise CheckpointError(f"{where}: pipeline class {pipeline!r} ({name}): {UNSERVED_MODEL_TYPES[name]}")
    supported = sorted({p for model in MODEL_TYPES.values() for p in model.pipelines})
    if pipeline not in supported:
        raise CheckpointError(
            f"{where}: pipeline class {pipeline!r} is not one the merge supports ({', '.join(supported)}); "
            f"msModelSlim's MXFP4 exports of these models merge; pass --model-type {'|'.join(MODEL_TYPES)} "
            "only for one of them"
        )
    raise CheckpointError(
        f"{where}: cannot infer the model type from _class_name {pipeline!r} with transformers {listed}; "
        f"pass --model-type {'|'.join(MODEL_TYPES)}"
    )


def resolve_model_type(model_type: str, original: Path) -> str:
    """The concrete model type: ``model_type`` itself (checked against ``model_index.json``) or, for
    ``auto``, the one ``model_index.json`` describes (its pipeline class and transformers)."""
    index = _read_model_index(original)
    listed = _listed_transformers(index)
    if model_type == AUTO:
        return _auto_model_type(index, listed, original / "model_index.json")
    if model_type in UNSERVED_MODEL_TYPES:
        raise CheckpointError(f"--model-type {model_type}: {UNSERVED_MODEL_TYPES[model_type]}")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(
            f"unknown model type {model_type!r}; expected one of {', '.join([*MODEL_TYPES, AUTO])}"
        )
    expected = [source.folder for source in MODEL_TYPES[model_type].transformers]
    if listed != expected:
        raise CheckpointError(
            f"{original / 'model_index.json'}: lists transformers {listed}, but {model_type} has {expected}"
        )
    return model_type


def _check_options(
    weight_layout: str, non_block_quantized: str, max_shard_size: int | None, mxfp8_layers: str
) -> None:
    if mxfp8_layers not in MXFP8_POLICIES:
        raise CheckpointError(f"mxfp8 layers {mxfp8_layers!r}; expected one of {', '.join(MXFP8_POLICIES)}")
    if weight_layout not in WEIGHT_LAYOUTS:
        raise CheckpointError(f"weight layout {weight_layout!r}; expected one of {', '.join(WEIGHT_LAYOUTS)}")
    if non_block_quantized not in NON_BLOCK_POLICIES:
        raise CheckpointError(
            f"non-block policy {non_block_quantized!r}; expected {', '.join(NON_BLOCK_POLICIES)}"
        )
    if max_shard_size is not None and max_shard_size <= 0:
        raise CheckpointError(f"max shard size must be positive, got {max_shard_size}")


def _check_input_dirs(original: Path, quant: Path) -> None:
    if not original.is_dir():
        raise CheckpointError(f"original model directory {original} does not exist")
    if not quant.is_dir():
        raise CheckpointError(f"quantized export directory {quant} does not exist")


def _outputs(plans: list[TransformerPlan]) -> list[ComponentOutput]:
    """What :func:`~vllm_omni_mxfp4.publish.output.publish` writes for each merged transformer."""
    return [
        ComponentOutput(
            plan.report.name, plan.report, plan.shards, plan.config, {DESCRIPTION_NAME: plan.description},
            plan.extra_files,
        )
        for plan in plans
    ]  # fmt: skip


def _model_names(
    model: ModelType, pipeline: str | None, directory: Path, provider: NamesProvider
) -> ModelNames:
    """One original transformer's runtime names, from ``provider`` (vLLM-Omni's model class)."""
    config = original_config(directory, model.transformer_class)
    tensors = {name: (ref.dtype, ref.shape) for name, ref in diffusers_archive(directory).items()}
    names = derived_model_names(
        directory, model.transformer_class, config, tensors, provider, pipeline, model.export_names
    )
    found = disagreeing_blocks(names.block_lists, tensors)
    if found is not None:
        path, built, held = found
        raise CheckpointError(
            f"{directory / 'config.json'}: disagrees with the original's weights: vLLM-Omni's {names.model_class} "
            f"built from it has {built} {path}{layer_count_keys(config, built)}, but the weights hold {path} "
            f"{block_spans(held)} ({len(held)}). Use the config.json that came with these weights (or correct "
            "its layer count) before merging: the engine builds the model from it"
        )
    return names


def _plan_transformers(
    model: ModelType, original: Path, quant: Path, provider: NamesProvider, **options
) -> list[TransformerPlan]:
    """Validate and plan every transformer of the model (``options``: those of :func:`plan_transformer`).

    Every original is checked for being already quantized first, so that this is what a merge of a
    quantized original reports, before anything the exports would say.
    """
    sources = model.transformers
    pipeline = _read_model_index(original).get("_class_name")
    for source in sources:
        check_original_unquantized(original / source.folder, model.transformer_class)
    folders = {s.folder: original / s.folder for s in sources}
    return [
        plan_transformer(
            s.folder,
            original / s.folder,
            s.export_dir(quant),
            names=_model_names(model, pipeline, original / s.folder, provider),
            siblings={f: d for f, d in folders.items() if f != s.folder},
            **options,
        )
        for s in sources
    ]


def _log_written(plans: list[TransformerPlan]) -> None:
    for plan in plans:
        logger.info(
            "%s: %d layers quantized, %d kept BF16, %d bytes in, %d bytes out, %.2f s",
            plan.report.name,
            plan.report.layers_quantized,
            plan.report.layers_bf16,
            plan.report.bytes_in,
            plan.report.bytes_out,
            plan.report.seconds,
        )


def merge(
    model_type: str,
    original_model: str | os.PathLike,
    quant_path: str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    weight_layout: str = "packed",
    max_shard_size: int | None = None,
    dry_run: bool = False,
    overwrite: bool = False,
    non_block_quantized: str = "error",
    mxfp8_layers: str = "keep",
    progress: bool | None = None,
    names_provider: NamesProvider | None = None,
) -> MergeReport:
    """Merge msModelSlim MXFP4 output into a copy of the original diffusers pipeline. ``model_type``:
    a key of :data:`MODEL_TYPES` or ``"auto"``; ``weight_layout`` ``"packed"`` keeps the uint8 ``(N,
    K/2)`` weights, ``"numeric"`` writes their FP4 values as BF16 ``(N, K)``; ``max_shard_size`` (bytes)
    shards each transformer's weights; ``mxfp8_layers``: ``"keep"`` W8A8 MXFP8 layers or take them from
    the original (``"bf16"``); ``dry_run`` validates and reports without writing; ``progress``: a tqdm bar
    on stderr (``None``: only on a terminal); ``names_provider``: default
    :func:`~vllm_omni_mxfp4.models.derive_names`. Raises
    :class:`CheckpointError` for invalid input; on any failure or interruption no output is left."""
    start = time.perf_counter()
    _check_options(weight_layout, non_block_quantized, max_shard_size, mxfp8_layers)
    original, quant, output = (Path(p).absolute() for p in (original_model, quant_path, output_path))
    stale = handle_stale_staging(output, dry_run)
    _check_input_dirs(original, quant)
    resolved_type = resolve_model_type(model_type, original)
    check_output(output, [original, quant], overwrite)
    model = MODEL_TYPES[resolved_type]
    plans = _plan_transformers(
        model,
        original,
        quant,
        names_provider or derive_names,
        weight_layout=weight_layout,
        max_shard_size=max_shard_size,
        non_block_quantized=non_block_quantized,
        mxfp8_layers=mxfp8_layers,
    )
    components = component_files(original, {source.folder for source in model.transformers})
    report = MergeReport(
        resolved_type, str(original), str(quant), str(output), weight_layout, dry_run,
        [plan.report for plan in plans], len(components), sum((original / rel).stat().st_size for rel in components),
        0.0, removed_stale=[] if dry_run else stale, stale_staging=stale if dry_run else [],
    )  # fmt: skip
    if not dry_run:
        publish(
            original,
            output,
            components,
            _outputs(plans),
            desc="merge",
            progress=progress,
            overwrite=overwrite,
        )
        _log_written(plans)
    report.seconds = round(time.perf_counter() - start, 3)
    return report
