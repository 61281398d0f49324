"""Which original an export was made from.

msModelSlim copies every tensor it does not quantize, so the export's FLOAT tensors outside the
Linears (norms, modulation tables, the patch embedding: small, never smoothed, never quantized) hold
exactly the numbers of the original the export was made from. The two experts of a Wan2.2 A14B
model are trained apart, so these numbers tell them apart. :func:`check_origin` compares them value
for value (any dtype; values, not bytes, so a lossless cast still matches) with the original being
merged and, when they differ, with the model's other transformers, and names the one they match: a
swapped pair of expert exports, or one export given for both experts, is refused before anything
is written.
"""

from __future__ import annotations

from pathlib import Path

from ..config.keys import layer_order
from ..errors import CheckpointError
from ..models.wan import LINEAR
from ..safetensors_io import TensorRef, diffusers_archive, first_difference
from .export import FLOAT_LABEL
from .validate import MergeInputs


def identity_tensors(inputs: MergeInputs) -> list[str]:
    """The export's FLOAT tensors outside the Linears that the original also has (diffusers names)."""
    names = (
        name
        for name, t in inputs.mapped.items()
        if t.label == FLOAT_LABEL and t.place.kind != LINEAR and name in inputs.original
    )
    return sorted(names, key=layer_order)


def _first_mismatch(inputs: MergeInputs, names: list[str], original: dict[str, TensorRef]) -> str | None:
    """The first of ``names`` whose export values differ from ``original``'s (or that it lacks)."""
    for name in names:
        ref = original.get(name)
        if ref is None or ref.shape != inputs.mapped[name].ref.shape:
            return name
        if first_difference(inputs.mapped[name].ref, ref) is not None:
            return name
    return None


def check_origin(inputs: MergeInputs, siblings: dict[str, Path]) -> None:
    """Refuse an export whose unquantized tensors are not those of ``inputs``' original.

    ``siblings`` are the model's other transformers (folder name -> original directory), the
    originals a swapped or duplicated expert export is looked for in.
    """
    names = identity_tensors(inputs)
    differing = _first_mismatch(inputs, names, inputs.original)
    if differing is None:
        return
    export = inputs.export.directory
    compared = f"{len(names)} unquantized norm, modulation and embedding tensors, compared value for value"
    for folder, directory in siblings.items():
        if _first_mismatch(inputs, names, diffusers_archive(directory)) is None:
            raise CheckpointError(
                f"{export}: this export was made from {folder} ({directory}), not from {inputs.name} "
                f"({inputs.original_dir}): its {compared}, equal {folder}'s and differ from "
                f"{inputs.name}'s (first {differing}); the expert exports are swapped, or one export "
                f"was given for both: {inputs.name} needs the msModelSlim export of {inputs.original_dir}"
            )
    raise CheckpointError(
        f"{export}: was not made from {inputs.original_dir}: of its {compared}, {differing} "
        f"differs from the original's; pass the original this export was made from, or re-export it"
    )
