"""Plan one merged transformer: which input bytes make each output tensor, its config and its report.

:func:`plan_transformer` first checks the export against the original (:mod:`.validate`), then
decides every output tensor without reading any weight: the original's tensors with the export's
versions overlaid, each quantized Linear's weight (packed, or unpacked to BF16 values), scales and
Smooth vector. Nothing is written here, so ``--dry-run`` is exactly this step.

A DualScale layer that msModelSlim did not smooth gets an identity ``mul_scale`` (ones): our runtime
loads such a layer without one as the identity, but vLLM-Omni's own DualScale method reads an
uninitialised ``mul_scale`` when the checkpoint has none (:data:`IDENTITY_SMOOTH_FORMATS`). W8A8 MXFP8 layers (msModelSlim's shipped Wan2.2 recipes) are written
as stored and listed in ``mxfp8_layers``, or, with ``mxfp8="bf16"``, taken from the original and
listed in ``ignored_layers``. Online Q/K rotation records are left out of the weights and recorded in
``online_rotation``; FA3 records are reported per attention (attention stays BF16) and left out. The ``quantization_config`` written to ``config.json`` comes from the
runtime's own config classes (:mod:`vllm_omni_mxfp4.config`), so the runtime accepts what the merge
writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from vllm_omni_mxfp4 import spec
from vllm_omni_mxfp4.config import Mxfp4Config, Mxfp4DualScaleConfig

from ..config.keys import layer_order
from ..errors import CheckpointError, read_json_object, require_regular_file
from ..models.names import ModelNames
from ..safetensors_io import (
    CopyBytes,
    OnesF32,
    OutputTensor,
    TensorRef,
    UnpackFp4ToBf16,
    WidenToF32,
    diffusers_archive,
    split_into_shards,
)
from .export import FLOAT_LABEL, read_export
from .origin import check_origin
from .rotation import REASON as ROTATION_REASON
from .validate import (
    ADDED_LEAVES,
    MUL_SCALE,
    MXFP8,
    MXFP8_POLICIES,
    NON_BLOCK_POLICIES,
    PAIR_LEAVES,
    Layers,
    MergeInputs,
)

IDENTITY_SMOOTH_FORMATS = ("mxfp4_dualscale",)
"""Formats whose unsmoothed layers the merge writes with an identity ``mul_scale``: vLLM-Omni's own
DualScale method registers ``mul_scale`` with ``torch.empty`` and would read garbage without one."""

__all__ = [
    "DESCRIPTION_NAME",
    "MXFP8_POLICIES",
    "NON_BLOCK_POLICIES",
    "WEIGHT_LAYOUTS",
    "TransformerPlan",
    "TransformerReport",
    "check_original_unquantized",
    "original_config",
    "plan_transformer",
]

DESCRIPTION_NAME = "quant_model_description.json"
WEIGHT_LAYOUTS = ("packed", "numeric")
_WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".index.json")


@dataclass
class TransformerReport:
    """What the merge did (or, in a dry run, would do) to one transformer."""

    name: str
    quant_dir: str
    description: str
    saver: str
    quant_method: str
    layers_quantized: int
    layers_bf16: int
    smooth_layers: int
    ignored_layers: list[str]
    require_smooth_scale: bool | None
    #: Runtime Linears written as W8A8 MXFP8 (``mxfp8_layers``) ...
    mxfp8_layers: list[str]
    #: ... and those msModelSlim stored as W8A8 MXFP8 but written from the BF16 original.
    mxfp8_to_bf16: list[str]
    #: FA3 records: runtime attention -> msModelSlim's attention dtype; every one runs in BF16.
    fa3_attention: dict[str, str]
    #: The online rotation record written to the config (``None``: the export has none).
    online_rotation: dict | None
    #: Runtime Linears with a stored low-rank pair (msModelSlim ``svd_res``) -> rank (``svd_lowrank_layers``).
    low_rank_layers: dict[str, int]
    tensors: int
    tensors_from_original: int
    bytes_in: int
    bytes_out: int
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass
class TransformerPlan:
    """Everything needed to write one merged transformer directory."""

    report: TransformerReport
    original_dir: Path
    shards: list[list[OutputTensor]]
    config: dict
    description: dict[str, str]
    extra_files: list[Path]


@dataclass
class _Outputs:
    """The output tensors of one transformer, their description labels and the input bytes they read."""

    tensors: list[OutputTensor] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    from_original: int = 0
    bytes_in: int = 0

    def add(self, tensor: OutputTensor, read: TensorRef | None = None, label: str | None = None) -> None:
        """``tensor``, made from the bytes of ``read`` (counted as input) and described by ``label``."""
        self.tensors.append(tensor)
        if label is not None:
            self.labels[tensor.name] = label
        if read is not None:
            self.bytes_in += read.nbytes

    def copy(self, name: str, ref: TensorRef, label: str) -> None:
        """The bytes of ``ref``, unchanged, as tensor ``name``."""
        self.add(OutputTensor(name, ref.dtype, ref.shape, CopyBytes(ref)), ref, label)

    def description(self, model_quant_type: str) -> dict[str, str]:
        """The remapped ``quant_model_description.json``: the labels in natural order."""
        labels = {name: self.labels[name] for name in sorted(self.labels, key=layer_order)}
        return {**labels, "model_quant_type": model_quant_type}


def _add_original_tensors(inputs: MergeInputs, layers: Layers, out: _Outputs) -> None:
    """Every tensor of the original except quantized weights: the export's version where it has one."""
    quantized = set(layers.quantized)
    for name in sorted(inputs.original, key=layer_order):
        place = inputs.places[name]
        if place.layer in quantized and place.leaf == "weight":
            continue
        exported = None if place.layer in layers.replaced else inputs.mapped.get(name)
        if name in inputs.same_values:  # the export's cast of the original: keep the original's dtype
            out.copy(name, inputs.original[name], exported.label)
        elif exported is None:
            out.from_original += 1
            out.copy(name, inputs.original[name], FLOAT_LABEL)
        else:
            out.copy(name, exported.ref, exported.label)


def _add_quantized_tensors(inputs: MergeInputs, layer: str, layout: str, out: _Outputs) -> None:
    """A quantized Linear's weight (packed, or unpacked to BF16), scales and Smooth vector."""
    tensors = inputs.by_layer[layer]
    weight, label = tensors["weight"].ref, inputs.layer_label(layer)
    if layout == "packed" or inputs.layer_format(layer) == MXFP8:  # FP8 is stored as numbers already
        out.copy(f"{layer}.weight", weight, label)
    else:
        shape = (weight.shape[0], weight.shape[1] * 2)
        out.add(OutputTensor(f"{layer}.weight", "BF16", shape, UnpackFp4ToBf16(weight)), weight, label)
    if MUL_SCALE not in tensors and inputs.layer_format(layer) in IDENTITY_SMOOTH_FORMATS:
        # A layer msModelSlim did not smooth gets the identity, which leaves its activations unchanged.
        k = weight.shape[1] * 2
        out.add(OutputTensor(f"{layer}.{MUL_SCALE}", "F32", (k,), OnesF32(k)))
    for leaf in ADDED_LEAVES:
        if leaf not in tensors:
            continue
        ref, label = tensors[leaf].ref, tensors[leaf].label
        if ref.dtype in ("U8", "F32") or leaf in PAIR_LEAVES:  # a pair stays in its stored dtype
            out.copy(f"{layer}.{leaf}", ref, label)
        else:  # a BF16 / F16 Smooth vector, widened exactly: the runtime reads float32
            out.add(OutputTensor(f"{layer}.{leaf}", "F32", ref.shape, WidenToF32(ref)), ref, label)


def _output_tensors(inputs: MergeInputs, layers: Layers, layout: str) -> _Outputs:
    out = _Outputs()
    _add_original_tensors(inputs, layers, out)
    for layer in layers.quantized:
        _add_quantized_tensors(inputs, layer, layout, out)
    return out


def _smooth_count(inputs: MergeInputs, layers: Layers) -> int:
    return sum(1 for layer in layers.quantized if MUL_SCALE in inputs.by_layer[layer])


def _require_smooth_scale(inputs: MergeInputs, layers: Layers) -> bool | None:
    """``require_smooth_scale`` for a method that has the key (``mxfp4``): true iff every MXFP4 layer
    is smoothed (MXFP8 layers have no Smooth). ``None`` for ``mxfp4_dualscale``, which has no such key."""
    if inputs.export.quant_method in IDENTITY_SMOOTH_FORMATS:
        return None
    mxfp4 = len(layers.quantized) - len(layers.mxfp8)
    smoothed = _smooth_count(inputs, layers)
    if 0 < smoothed < mxfp4:
        inputs.warn(
            f"Smooth on {smoothed} of {mxfp4} MXFP4 layers; require_smooth_scale "
            "is false so that the others load with identity scaling"
        )
    return mxfp4 > 0 and smoothed == mxfp4


def _quantization_config(
    quant_method: str, ignored: list[str], require_smooth: bool | None, extra: dict[str, object]
) -> dict:
    """The ``quantization_config`` block, from the runtime config class of ``quant_method``;
    ``extra``: the keys only some checkpoints carry (``mxfp8_layers``, ``online_rotation``)."""
    if quant_method == Mxfp4DualScaleConfig.METHOD:
        config = Mxfp4DualScaleConfig(is_checkpoint_serialized=True, ignored_layers=ignored, **extra)
    else:
        config = Mxfp4Config(
            is_checkpoint_mxfp4_serialized=True,
            ignored_layers=ignored,
            require_smooth_scale=require_smooth,
            **extra,
        )
    return config.to_checkpoint_dict()


def _runtime_names(layers: list[str], names: ModelNames) -> list[str]:
    return sorted({names.runtime_layer_name(layer) for layer in layers}, key=layer_order)


def _low_rank_layers(inputs: MergeInputs, layers: Layers) -> dict[str, int]:
    """``svd_lowrank_layers``: the rank of each runtime Linear whose pieces carry a stored pair (the
    pieces of a fused Linear share one rank: :meth:`MergeInputs.check_fused_qkv`)."""
    ranks = {}
    for layer in layers.quantized:
        rank = inputs.layer_rank(layer)
        if rank:
            ranks[inputs.names.runtime_layer_name(layer)] = rank
    return {name: ranks[name] for name in sorted(ranks, key=layer_order)}


def _fa3_attention(inputs: MergeInputs) -> dict[str, str]:
    """FA3 records by runtime attention (``blocks.N.attn1``, ``transformer_blocks.N.attn``); every one
    runs in BF16 in vLLM-Omni."""
    found = {}
    for attention, dtype in inputs.export.fa_markers.items():
        try:
            runtime = inputs.names.attention(attention)[0]
        except CheckpointError as exc:
            raise CheckpointError(
                f"{inputs.export.description}: FA3 record {attention}.quant_type names no attention ({exc})"
            ) from None
        found[runtime] = dtype
    if found:
        inputs.warn(
            f"FA3 attention quantization on {len(found)} attention layer(s) "
            f"({', '.join(sorted(set(found.values())))}): attention stays BF16 in vLLM-Omni (higher precision "
            "than msModelSlim calibrated for, slower than MindIE-SD's quantized attention)"
        )
    return dict(sorted(found.items(), key=lambda item: layer_order(item[0])))


def _online_rotation(inputs: MergeInputs) -> dict | None:
    """The config record of the accepted online Q/K rotations (informational: not applied)."""
    attentions = inputs.rotations.runtime_layers()
    if not attentions:
        return None
    inputs.warn(f"online Q/K rotation on {len(attentions)} attention layer(s) not applied: {ROTATION_REASON}")
    return {"layers": sorted(attentions, key=layer_order), "applied": False, "reason": ROTATION_REASON}


def original_config(original_dir: Path, transformer_class: str) -> dict:
    """The original ``config.json``: a ``transformer_class``'s, without a ``quantization_config``."""
    path = original_dir / "config.json"
    config = read_json_object(path, if_missing="the original transformer needs its config.json")
    if "quantization_config" in config:
        raise CheckpointError(
            f"{path}: already has a quantization_config; --original-model must be the BF16 original "
            "(this is a merged or otherwise quantized checkpoint)"
        )
    if config.get("_class_name") != transformer_class:
        raise CheckpointError(
            f"{path}: _class_name is {config.get('_class_name')!r}; expected {transformer_class!r}"
        )
    return config


def check_original_unquantized(original_dir: Path, transformer_class: str) -> None:
    """Refuse an already-quantized original first, before any comparison with the export: its
    ``config.json`` has a ``quantization_config``, or it holds scales or non-float weights."""
    if not original_dir.is_dir():
        raise CheckpointError(f"original transformer directory {original_dir} does not exist")
    original_config(original_dir, transformer_class)
    for name, ref in sorted(diffusers_archive(original_dir).items(), key=lambda item: layer_order(item[0])):
        if name.rsplit(".", 1)[-1] in ADDED_LEAVES or ref.dtype not in spec.FLOAT_DTYPES:
            raise CheckpointError(
                f"{ref.path}: original tensor {name!r} ({ref.dtype}) is a quantized checkpoint's tensor; "
                "the original is already quantized: --original-model must be the BF16 original"
            )


def _extra_files(original_dir: Path) -> list[Path]:
    """Files of the original transformer directory that are neither weights nor the rewritten JSON
    (each a regular file, also inside a subdirectory: a FIFO or a device is refused unopened)."""
    extras = sorted(
        p
        for p in original_dir.iterdir()
        if p.name not in ("config.json", DESCRIPTION_NAME) and not p.name.endswith(_WEIGHT_FILE_SUFFIXES)
    )
    for extra in extras:
        inner = [Path(root) / name for root, _, names in os.walk(extra) for name in names]
        for path in inner if extra.is_dir() else [extra]:
            require_regular_file(path)
    return extras


def _report(
    inputs: MergeInputs, layers: Layers, out: _Outputs, quant: dict, require_smooth: bool | None
) -> TransformerReport:
    export = inputs.export
    to_bf16 = [layer for layer in layers.replaced if inputs.layer_format(layer) == MXFP8]
    return TransformerReport(
        name=inputs.name,
        quant_dir=str(export.directory),
        description=export.description.name,
        saver=export.saver,
        quant_method=export.quant_method,
        layers_quantized=len(layers.quantized),
        layers_bf16=len(layers.bf16),
        smooth_layers=_smooth_count(inputs, layers),
        ignored_layers=list(quant.get("ignored_layers", [])),
        require_smooth_scale=require_smooth,
        mxfp8_layers=list(quant.get("mxfp8_layers", [])),
        mxfp8_to_bf16=_runtime_names(to_bf16, inputs.names),
        fa3_attention=_fa3_attention(inputs),
        online_rotation=quant.get("online_rotation"),
        low_rank_layers=dict(quant.get("svd_lowrank_layers", {})),
        tensors=len(out.tensors),
        tensors_from_original=out.from_original,
        bytes_in=out.bytes_in,
        bytes_out=sum(t.nbytes for t in out.tensors),
        warnings=inputs.warnings,
    )


def plan_transformer(
    name: str,
    original_dir: Path,
    quant_dir: Path,
    *,
    names: ModelNames,
    weight_layout: str = "packed",
    max_shard_size: int | None = None,
    non_block_quantized: str = "error",
    mxfp8_layers: str = "keep",
    siblings: dict[str, Path] | None = None,
) -> TransformerPlan:
    """Validate one transformer's export against its original and plan the merged tensors.

    ``mxfp8_layers`` (:data:`MXFP8_POLICIES`): ``keep`` the export's W8A8 MXFP8 layers, or ``bf16``:
    take them from the original. ``names`` are the transformer's runtime names (derived from
    vLLM-Omni's model class, :class:`~.names.ModelNames`). ``siblings`` are the model's other transformers (folder name ->
    original directory): an export made from one of them (swapped or duplicated experts) is
    refused, naming it.
    """
    check_original_unquantized(original_dir, names.model_class)
    inputs = MergeInputs(name, original_dir, read_export(quant_dir), non_block_quantized, names, mxfp8_layers)
    layers = inputs.decide_layers()
    if not layers.quantized:
        raise CheckpointError(
            f"{inputs.export.description}: no Linear stays quantized (its only quantized layers are W8A8 "
            "MXFP8 and --mxfp8-layers is bf16); nothing to merge"
        )
    check_origin(inputs, siblings or {})
    out = _output_tensors(inputs, layers, weight_layout)
    require_smooth = _require_smooth_scale(inputs, layers)
    extra: dict[str, object] = {}
    if layers.mxfp8:
        extra["mxfp8_layers"] = _runtime_names(layers.mxfp8, names)
    rotation = _online_rotation(inputs)
    if rotation is not None:
        extra["online_rotation"] = rotation
    low_rank = _low_rank_layers(inputs, layers)
    if low_rank:
        extra["svd_lowrank_layers"] = low_rank
    quant = _quantization_config(
        inputs.export.quant_method, _runtime_names(layers.bf16, names), require_smooth, extra
    )
    config = {**original_config(original_dir, names.model_class), "quantization_config": quant}
    return TransformerPlan(
        report=_report(inputs, layers, out, quant, require_smooth),
        original_dir=original_dir,
        shards=split_into_shards(out.tensors, max_shard_size, layer_order),
        config=config,
        description=out.description(inputs.export.label),
        extra_files=_extra_files(original_dir),
    )
