"""Reader for msModelSlim's W4A4 MXFP4 exports (both savers, single file or sharded).

msModelSlim 26.1 writes one directory per transformer (per expert for the two-expert Wan2.2 models):

- ``ascendv1`` saver: ``quant_model_description.json`` + ``quant_model_weights.safetensors``; the
  description also holds ``version``, ``model_quant_type`` (the highest-priority type seen),
  ``metadata``, ``group_size`` and ``optional``.
- ``mindie_format`` saver: ``quant_model_description_<type>.json`` +
  ``quant_model_weight_<type>.safetensors`` (``model_quant_type`` is the last type written), or, when
  sharded, ``quant_model_weight-0000i-of-0000n.safetensors`` + ``quant_model_weight.safetensors.index.json``
  (the shards keep the generic prefix).

The description maps every saved tensor to a label: ``FLOAT`` or the quantization type of its layer.
Only ``FLOAT``, ``W4A4_MXFP4``, ``W4A4_MXFP4_DUALSCALE``, their ``_SVD`` forms and ``W8A8_MXFP8`` are
accepted; one export holds at most one of the two MXFP4 formats (the merged checkpoint's method), and
msModelSlim's shipped Wan2.2 recipes add W8A8 MXFP8 layers (blocks 0-4) next to single-scale MXFP4
ones. An ``_SVD`` label marks a Linear that msModelSlim's ``svd_res`` processor wrapped: its weight is
the residual, quantized as the base label says, and ``svd_lowrank_l1`` / ``svd_lowrank_l2`` (FLOAT)
are its low-rank pair; only the ascendv1 saver writes them (the mindie_format saver drops the pair).

Entries without a tensor: ``<attention>.quant_type`` records the FA3 (attention quantization) dtype
of one attention, with dynamic scales (nothing stored); a top-level ``fa_quant_type`` is written only
for FA3 ``per_head`` scales, which are stored tensors a BF16 attention cannot use, so it is refused.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from vllm_omni_mxfp4 import spec

from ..errors import CheckpointError, read_json_object
from ..safetensors_io import TensorRef, open_archive

logger = logging.getLogger(__name__)

FLOAT_LABEL = "FLOAT"
MXFP8_LABEL = "W8A8_MXFP8"
#: The suffix msModelSlim's ascendv1 saver appends to the label of a Linear wrapped by its ``svd_res``
#: processor (``on_svd_wrapper``: ``_SVD``, or ``_SVD_DYNAMIC`` in place of ``_DYNAMIC``); the Linear's
#: weight is then the residual and the export stores its low-rank pair, labelled FLOAT.
SVD_SUFFIX = "_SVD"
_BASE_LABELS: dict[str, str] = {"W4A4_MXFP4": "mxfp4", "W4A4_MXFP4_DUALSCALE": "mxfp4_dualscale"}
#: msModelSlim's SVD labels (a residual plus a stored low-rank pair) -> the label without the suffix.
SVD_LABELS: dict[str, str] = {f"{label}{SVD_SUFFIX}": label for label in _BASE_LABELS}
#: msModelSlim label -> vLLM-Omni ``quant_method``.
QUANT_LABELS: dict[str, str] = {
    **_BASE_LABELS,
    **{svd: _BASE_LABELS[base] for svd, base in SVD_LABELS.items()},
}
#: The labels whose Linears msModelSlim's ascendv1 saver writes the bias under (``on_w4a4_mx_dynamic_dual_scale``
#: writes ``prefix + ".bias"`` with ``"W4A4_MXFP4_DUALSCALE"``; the SVD wrapper appends ``_SVD`` to it);
#: every other writer of both savers labels a bias FLOAT.
ASCENDV1_LABELLED_BIAS = tuple(label for label, method in QUANT_LABELS.items() if method == "mxfp4_dualscale")
#: msModelSlim label -> the format of :mod:`vllm_omni_mxfp4.spec` its Linears are stored in.
LAYER_FORMATS: dict[str, str] = {**QUANT_LABELS, MXFP8_LABEL: "mxfp8"}
SUPPORTED_LABELS = (FLOAT_LABEL, *LAYER_FORMATS)
#: Tensors msModelSlim always labels FLOAT, whatever their Linear's format (its savers'
#: ``write_tensor(prefix + ".bias", "FLOAT", ...)``, ``(".div.mul_scale", "FLOAT", ...)`` and the SVD
#: wrapper's ``write_tensor(name, "FLOAT", param)`` for its pair).
FLOAT_ONLY_LEAVES = ("bias", "mul_scale", spec.LOW_RANK_L1, spec.LOW_RANK_L2)
#: The method of an export whose only quantized label is W8A8 MXFP8 (the recipes' method is ``mxfp4``).
MXFP8_ONLY_METHOD = "mxfp4"
#: The recipe element that writes each supported label, for the message refusing any other label.
_LABEL_SOURCES = (
    "a recipe step 'linear_quant' writes the label of its qconfig; supported: weight and act dtype "
    "mxfp4 scope per_block (W4A4_MXFP4), mxfp4 dual_scale (W4A4_MXFP4_DUALSCALE), mxfp8 per_block "
    "(W8A8_MXFP8); change that step's qconfig (or exclude its layers) and re-export"
)

_METADATA_KEYS = frozenset(
    {"version", "model_quant_type", "metadata", "group_size", "optional", "fa_quant_type"}
)
_FA_MARKER_SUFFIX = ".quant_type"
DESCRIPTION_GLOB = "quant_model_description*.json"
WEIGHTS_GLOB = "quant_model_weight*.safetensors"
INDEX_GLOB = "quant_model_weight*.safetensors.index.json"


@dataclass
class QuantExport:
    """One msModelSlim export directory: tensor labels, tensor locations and the detected format."""

    directory: Path
    description: Path
    saver: str
    label: str
    quant_method: str
    labels: dict[str, str]
    tensors: dict[str, TensorRef]
    #: FA3 attention-quantization records: attention module (export name) -> dtype (``MXFP4_DYNAMIC``).
    fa_markers: dict[str, str] = field(default_factory=dict)

    @property
    def files(self) -> list[Path]:
        return sorted({ref.path for ref in self.tensors.values()})


def _find_description(directory: Path) -> Path:
    found = sorted(directory.glob(DESCRIPTION_GLOB))
    if not found:
        raise CheckpointError(
            f"{directory}: missing msModelSlim description file ({DESCRIPTION_GLOB}); "
            "pass the directory msModelSlim saved"
        )
    if len(found) > 1:
        raise CheckpointError(
            f"{directory}: several description files ({', '.join(p.name for p in found)}); keep exactly one"
        )
    return found[0]


def _find_weights(directory: Path) -> tuple[list[Path], Path | None]:
    indexes = sorted(directory.glob(INDEX_GLOB))
    if len(indexes) > 1:
        raise CheckpointError(f"{directory}: several weight indexes ({', '.join(p.name for p in indexes)})")
    files = sorted(directory.glob(WEIGHTS_GLOB))
    others = sorted(p.name for p in directory.glob("*.safetensors") if p not in files)
    if others:
        raise CheckpointError(
            f"{directory}: unexpected safetensors file(s) {others}; msModelSlim writes {WEIGHTS_GLOB} only"
        )
    if not files:
        raise CheckpointError(f"{directory}: no msModelSlim weight file ({WEIGHTS_GLOB})")
    return files, (indexes[0] if indexes else None)


def _check_metadata(description: Path, metadata: dict[str, object], used: list[str]) -> None:
    """``model_quant_type`` is one of the labels used: msModelSlim's ``mindie_format`` saver writes
    the last quantized Linear's label, ``ascendv1`` the highest-priority one, so in a mixed
    W8A8 MXFP8 / W4A4 MXFP4 export it names either."""
    mqt = metadata.get("model_quant_type")
    if mqt is not None and mqt not in used:
        raise CheckpointError(
            f"{description}: model_quant_type {mqt!r} disagrees with the tensor labels ({', '.join(used)})"
        )
    if "fa_quant_type" in metadata:
        raise CheckpointError(
            f"{description}: fa_quant_type {metadata['fa_quant_type']!r} records FA3 per_head attention "
            "scales (written by a recipe step 'fa3_quant' with qconfig scope per_head); vLLM-Omni runs "
            "attention in BF16 and cannot use them: use scope per_token or per_block, or drop that step"
        )
    group_size = metadata.get("group_size")
    if group_size is not None and group_size != spec.MX_BLOCK:
        raise CheckpointError(
            f"{description}: group_size is {group_size!r}; MXFP4 exports use {spec.MX_BLOCK}"
        )
    for key in ("metadata", "optional"):
        value = metadata.get(key)
        if value not in (None, {}):
            raise CheckpointError(
                f"{description}: unsupported {key!r} section {json.dumps(value)[:200]} "
                "(QuaRot rotations and other extras cannot be merged into a diffusers checkpoint)"
            )
    version = metadata.get("version")
    if version is not None and not isinstance(version, str):
        raise CheckpointError(f"{description}: 'version' must be a string, got {version!r}")


@dataclass
class _Description:
    """The entries of a description file, sorted by kind."""

    labels: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, object] = field(default_factory=dict)
    fa_markers: dict[str, str] = field(default_factory=dict)


def _read_description(description: Path) -> _Description:
    entries = read_json_object(
        description,
        if_missing="pass the directory msModelSlim saved",
        expected="a JSON object mapping tensor names to labels",
    )
    found = _Description()
    for key, value in entries.items():
        if key in _METADATA_KEYS:
            found.metadata[key] = value
        elif key.endswith(_FA_MARKER_SUFFIX):
            found.fa_markers[key[: -len(_FA_MARKER_SUFFIX)]] = str(value)
        elif isinstance(value, str):
            found.labels[key] = value
        else:
            raise CheckpointError(
                f"{description}: entry {key!r} is {json.dumps(value)[:100]}; expected a description label string"
            )
    return found


def bias_labels(saver: str, layer_label: str) -> tuple[str, ...]:
    """The labels msModelSlim's ``saver`` gives the bias of a Linear whose weight is ``layer_label``."""
    if saver == "ascendv1" and layer_label in ASCENDV1_LABELLED_BIAS:
        return (FLOAT_LABEL, layer_label)
    return (FLOAT_LABEL,)


def _check_labelled_tensors(
    description: Path, labels: dict[str, str], tensors: dict[str, TensorRef], saver: str
) -> None:
    """Every described tensor is stored, every stored tensor is described, every label is supported."""
    for name in labels:
        if name not in tensors:
            raise CheckpointError(f"{description}: describes tensor {name!r}, which no weight file holds")
    for name, ref in tensors.items():
        if name not in labels:
            raise CheckpointError(f"{ref.path}: tensor {name!r} has no label in {description.name}")
    for name, label in labels.items():
        if label == f"{MXFP8_LABEL}{SVD_SUFFIX}":
            raise CheckpointError(
                f"{description}: tensor {name!r} is labelled {label}, a W8A8 MXFP8 Linear with an svd_res "
                "low-rank pair; the branch is supported on W4A4 MXFP4 and DualScale Linears only. Exclude the "
                "MXFP8 layers from the svd_res step (its exclude list) and re-export"
            )
        if label not in SUPPORTED_LABELS:
            raise CheckpointError(
                f"{description}: tensor {name!r} has unsupported description label {label!r}; "
                f"supported labels: {', '.join(SUPPORTED_LABELS)} ({_LABEL_SOURCES})"
            )
    for name, label in labels.items():
        leaf = name.rpartition(".")[2]
        if leaf == "bias" and label in bias_labels(saver, label):
            continue
        if leaf in FLOAT_ONLY_LEAVES and label != FLOAT_LABEL:
            raise CheckpointError(
                f"{description}: tensor {name!r} is labelled {label}; msModelSlim labels every "
                f"{name.rpartition('.')[2]} FLOAT (its savers quantize only weights and their scales): the "
                "description was edited or belongs to other weights; export again, or restore the label FLOAT"
            )


def _quantization_labels(description: Path, labels: dict[str, str]) -> tuple[str, list[str]]:
    """The export's method label (its one MXFP4 label; ``W4A4_MXFP4`` when only W8A8 MXFP8 is used)
    and every quantized label it uses."""
    used = sorted({label for label in labels.values() if label != FLOAT_LABEL})
    if not used:
        raise CheckpointError(
            f"{description}: no tensor is quantized (every label is FLOAT); nothing to merge"
        )
    mxfp4 = [label for label in used if label in QUANT_LABELS]
    if len({QUANT_LABELS[label] for label in mxfp4}) > 1:
        first = {label: next(n for n, v in labels.items() if v == label) for label in mxfp4}
        shown = " and ".join(f"{label} (e.g. {first[label]!r})" for label in mxfp4)
        raise CheckpointError(f"{description}: mixes {shown}; a transformer must use one MXFP4 format")
    mxfp4 = [SVD_LABELS.get(label, label) for label in mxfp4]  # the method's label, without _SVD
    method_label = mxfp4[0] if mxfp4 else next(k for k, v in QUANT_LABELS.items() if v == MXFP8_ONLY_METHOD)
    return method_label, used


def read_export(directory: Path) -> QuantExport:
    """Read and check one export directory: description, weight files, labels, format."""
    if not directory.is_dir():
        raise CheckpointError(f"quantized export directory {directory} does not exist")
    description = _find_description(directory)
    found = _read_description(description)
    files, index = _find_weights(directory)
    tensors = open_archive(files, index)
    saver = "ascendv1" if "version" in found.metadata else "mindie_format"
    _check_labelled_tensors(description, found.labels, tensors, saver)
    label, used = _quantization_labels(description, found.labels)
    _check_metadata(description, found.metadata, used)
    return QuantExport(
        directory, description, saver, label, QUANT_LABELS[label], found.labels, tensors, found.fa_markers
    )
