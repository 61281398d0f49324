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
Only ``FLOAT``, ``W4A4_MXFP4`` and ``W4A4_MXFP4_DUALSCALE`` are accepted; one export holds one of the
two MXFP4 types.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from vllm_omni_mxfp4 import spec

from .errors import CheckpointError, read_json_object
from .safetensors_io import TensorRef, open_archive

logger = logging.getLogger(__name__)

FLOAT_LABEL = "FLOAT"
#: msModelSlim label -> vLLM-Omni ``quant_method``.
QUANT_LABELS: dict[str, str] = {"W4A4_MXFP4": "mxfp4", "W4A4_MXFP4_DUALSCALE": "mxfp4_dualscale"}
SUPPORTED_LABELS = (FLOAT_LABEL, *QUANT_LABELS)

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
    fa_markers: list[str] = field(default_factory=list)

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


def _check_metadata(description: Path, metadata: dict[str, object], label: str) -> None:
    mqt = metadata.get("model_quant_type")
    if mqt is not None and mqt != label:
        raise CheckpointError(
            f"{description}: model_quant_type {mqt!r} disagrees with the tensor labels ({label})"
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
    fa_markers: list[str] = field(default_factory=list)


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
            found.fa_markers.append(key)
        elif isinstance(value, str):
            found.labels[key] = value
        else:
            raise CheckpointError(
                f"{description}: entry {key!r} is {json.dumps(value)[:100]}; expected a description label string"
            )
    return found


def _check_labelled_tensors(description: Path, labels: dict[str, str], tensors: dict[str, TensorRef]) -> None:
    """Every described tensor is stored, every stored tensor is described, every label is supported."""
    for name in labels:
        if name not in tensors:
            raise CheckpointError(f"{description}: describes tensor {name!r}, which no weight file holds")
    for name, ref in tensors.items():
        if name not in labels:
            raise CheckpointError(f"{ref.path}: tensor {name!r} has no label in {description.name}")
    for name, label in labels.items():
        if label not in SUPPORTED_LABELS:
            raise CheckpointError(
                f"{description}: tensor {name!r} has unsupported description label {label!r}; "
                f"supported labels: {', '.join(SUPPORTED_LABELS)}"
            )


def _quantization_label(description: Path, labels: dict[str, str]) -> str:
    """The one MXFP4 label of the export."""
    used = sorted({label for label in labels.values() if label != FLOAT_LABEL})
    if not used:
        raise CheckpointError(
            f"{description}: no tensor is quantized (every label is FLOAT); nothing to merge"
        )
    if len(used) > 1:
        raise CheckpointError(
            f"{description}: mixes {' and '.join(used)}; a transformer must use one MXFP4 format"
        )
    return used[0]


def read_export(directory: Path) -> QuantExport:
    """Read and check one export directory: description, weight files, labels, format."""
    if not directory.is_dir():
        raise CheckpointError(f"quantized export directory {directory} does not exist")
    description = _find_description(directory)
    found = _read_description(description)
    files, index = _find_weights(directory)
    tensors = open_archive(files, index)
    _check_labelled_tensors(description, found.labels, tensors)
    label = _quantization_label(description, found.labels)
    _check_metadata(description, found.metadata, label)
    if found.fa_markers or "fa_quant_type" in found.metadata:
        logger.warning(
            "%s: %d attention (FA3) quantization marker(s) ignored; vLLM-Omni runs attention in BF16",
            description,
            len(found.fa_markers),
        )
    saver = "ascendv1" if "version" in found.metadata else "mindie_format"
    return QuantExport(
        directory, description, saver, label, QUANT_LABELS[label], found.labels, tensors, found.fa_markers
    )
