"""Check one transformer's msModelSlim export against its BF16 original, before anything is written.

The tensors of a quantized Linear, their dtypes, shapes and valid values are those of the format's
table in :mod:`vllm_omni_mxfp4.spec` (:func:`~vllm_omni_mxfp4.spec.checkpoint_tensors`), the same
table the runtime loader checks. On top of it (each violation is a :class:`CheckpointError` naming the
tensor or file):

- every export tensor name maps to a tensor (or, for quantization tensors, a Linear) of the
  original: through the exact Wan2.2 name table for exports of the original Wan modules, as is for
  exports that use diffusers names (Qwen-Image-Edit); every original tensor is one the model class
  loads (:class:`~.names.ModelNames`, derived from vLLM-Omni's class);
- a quantized Linear has every required tensor of its format, each labelled with the export's
  format (``mul_scale`` labelled FLOAT, the bias FLOAT or the format), and its bias iff the
  original has one; ``mul_scale`` is needed only where msModelSlim smoothed the layer (the merge
  writes an identity one for unsmoothed DualScale layers, :data:`.plan.IDENTITY_SMOOTH_FORMATS`);
- a FLOAT tensor is floating point with the original's shape; a Linear kept in BF16 has no scales
  and no Smooth (a BF16 Linear does not apply ``mul_scale`` at runtime);
- the Linears the model fuses into one runtime Linear (its loader's fused pieces: Wan's
  ``attn1.to_qkv``, Qwen-Image's ``attn.to_qkv`` and ``attn.add_kv_proj``) are all quantized or all
  BF16, and share one ``mul_scale`` (or none);
- only Linears the model builds with its quantization config are quantized (vLLM-Omni runs Wan's
  embedders and ``proj_out``, Qwen-Image's ``img_mod``/``txt_mod``, embedders and ``proj_out`` in
  BF16), unless the caller asks to take such layers from the original;
- a Linear's format is its weight's label: the export's MXFP4 format, or W8A8 MXFP8 (``mxfp8``, kept
  or, with ``mxfp8="bf16"``, taken from the BF16 original); a fused Q/K/V group shares one format;
- online Q/K rotation records (:mod:`.rotation`) are set apart, checked and kept out of the weights.

Only headers and the small tensors (scales, Smooth vectors, biases) are read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vllm_omni_mxfp4 import spec

from ..config.keys import layer_order
from ..errors import CheckpointError
from ..models.names import WAN_EXPORT_NAMES, ModelNames
from ..models.wan import LINEAR, TensorName
from ..safetensors_io import (
    CODE_DTYPES,
    TensorRef,
    diffusers_archive,
    first_bad_value,
    first_difference,
    first_nonfinite,
)
from .export import FLOAT_LABEL, LAYER_FORMATS, SVD_LABELS, QuantExport, bias_labels
from .rotation import ROWS_COMPARED, Rotations, decode_rows, is_rotation_record, read_rows

logger = logging.getLogger(__name__)

NON_BLOCK_POLICIES = ("error", "original")
#: ``--mxfp8-layers``: keep the export's W8A8 MXFP8 layers, or take them from the BF16 original.
MXFP8_POLICIES = ("keep", "bf16")
MXFP8 = "mxfp8"
MUL_SCALE = spec.MUL_SCALE.name
#: The tensors the BF16 original has for a Linear; the quantized formats add the others.
_ORIGINAL_LEAVES = ("weight", "bias")
#: The low-rank pair of a Linear msModelSlim's ``svd_res`` wrapped (:func:`vllm_omni_mxfp4.spec.low_rank_tensors`).
PAIR_LEAVES = (spec.LOW_RANK_L1, spec.LOW_RANK_L2)
#: Tensors a quantized Linear adds to the original's (in table order): scales, the Smooth vector and
#: a stored low-rank pair.
ADDED_LEAVES = (
    *dict.fromkeys(
        t.name for fmt in spec.FORMATS for t in spec.checkpoint_tensors(fmt) if t.name not in _ORIGINAL_LEAVES
    ),
    *PAIR_LEAVES,
)
_SCALE_LEAVES = tuple(leaf for leaf in ADDED_LEAVES if leaf != MUL_SCALE and leaf not in PAIR_LEAVES)
#: The value rule of every unquantized tensor (norms, biases, modulation tables, embedders, the
#: weights of Linears kept in BF16): the spec table's ``finite`` rule, as for a quantized Linear's bias.
UNQUANTIZED_VALUES = spec.VALUE_RULES[spec.BIAS.values]


@dataclass
class ExportTensor:
    """One tensor of the export, with its label and the diffusers tensor it maps to."""

    ref: TensorRef
    label: str
    export_name: str
    wrapped: bool
    place: TensorName


@dataclass
class Layers:
    """How each Linear of the original is written, in natural order."""

    quantized: list[str] = field(default_factory=list)
    bf16: list[str] = field(default_factory=list)
    #: Quantized in the export but taken from the original (``--non-block-quantized original``,
    #: ``--mxfp8-layers bf16``).
    replaced: set[str] = field(default_factory=set)
    #: The quantized layers written as W8A8 MXFP8 (a subset of ``quantized``).
    mxfp8: list[str] = field(default_factory=list)


#: Where msModelSlim 26.1's savers take the dtype of each float tensor of a quantized Linear from.
WRITTEN_DTYPES = {
    MUL_SCALE: "for a Linear's mul_scale: its original weight's dtype (the Smooth factors are computed "
    "in it: iter_smooth's compute_smooth_scale casts to the weight's dtype)",
    "bias": "for the bias of a quantized Linear (both savers write it .to(torch.float32))",
    "weight_dual_scale": "for DualScale coarse scales (the savers write them .to(torch.float32))",
    **dict.fromkeys(
        PAIR_LEAVES,
        "for a low-rank pair: its Linear's original weight dtype (svd_res casts the pair to the weight's dtype)",
    ),
}


def written_dtype(leaf: str, original_weight_dtype: str) -> str | None:
    """The safetensors dtype msModelSlim writes tensor ``leaf`` of a quantized Linear in (None: not a
    float tensor of fixed dtype), given the dtype of the Linear's original weight."""
    if leaf == MUL_SCALE or leaf in PAIR_LEAVES:
        return original_weight_dtype
    return "F32" if leaf in WRITTEN_DTYPES else None


def _fail(ref: TensorRef, what: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{ref.path}: {what} {ref.name!r} {problem}")


def _check_dtype_and_shape(
    t: ExportTensor, what: str, dtypes: frozenset[str] | tuple[str, ...], shape: tuple[int, ...], why: str
) -> None:
    if t.ref.dtype not in dtypes:
        raise _fail(t.ref, what, f"has dtype {t.ref.dtype}; expected {' or '.join(sorted(dtypes))}")
    if t.ref.shape != shape:
        raise _fail(t.ref, what, f"has shape {list(t.ref.shape)}; expected {list(shape)} {why}")


def check_record(
    ref: TensorRef, record: spec.CheckpointTensor, expected_shape: tuple[int, ...], why: str
) -> None:
    """One quantized Linear's tensor against its record (:func:`vllm_omni_mxfp4.spec.tensor_problem`:
    dtype, shape, values; packed weights are not read); a :class:`CheckpointError` naming the file,
    the tensor and ``why`` (the Linear it belongs to)."""
    problem = spec.tensor_problem(
        record, ref.dtype, ref.shape, expected_shape, lambda rule: first_bad_value(ref, lambda v: rule.bad(v, np)),
        codes=ref.dtype in CODE_DTYPES,
    )  # fmt: skip
    if problem is not None:
        raise _fail(ref, record.name, f"{problem} {why}")


def check_streamed_values(ref: TensorRef, what: str) -> None:
    """Every value of an unquantized tensor of any size is finite (read in bounded chunks)."""
    rule = UNQUANTIZED_VALUES  # "finite", checked on the exponent bits
    found = first_nonfinite(ref)
    if found is not None:
        at, value = found
        raise _fail(ref, what, f"holds {value} at {at}; expected {rule.expected}; usual cause: {rule.cause}")


def _allowed_labels(leaf: str, label: str, saver: str) -> tuple[str, ...]:
    """The description labels msModelSlim's ``saver`` gives tensor ``leaf`` of a Linear quantized as
    ``label``."""
    if leaf == MUL_SCALE or leaf in PAIR_LEAVES:
        return (FLOAT_LABEL,)
    if leaf == "bias":
        return bias_labels(saver, label)
    return (label,)


def _map_export(export: QuantExport, rotations: Rotations, names: ModelNames) -> dict[str, ExportTensor]:
    mapped: dict[str, ExportTensor] = {}
    for name in sorted(export.tensors, key=layer_order):
        if is_rotation_record(name):
            rotations.add(name, export.tensors[name])
            continue
        stripped, wrapped = names.strip_smooth_wrapper(name)
        try:
            place = names.export_to_diffusers(stripped)
        except CheckpointError:
            if names.export_names == WAN_EXPORT_NAMES:
                raise CheckpointError(
                    f"{export.description}: unknown tensor {name!r}; it is not in the exact Wan2.2 "
                    "original-name table (msModelSlim must quantize the original Wan modules)"
                ) from None
            raise CheckpointError(
                f"{export.description}: unknown tensor {name!r}; vLLM-Omni's {names.model_class} loads no "
                "tensor of that name (msModelSlim must quantize the diffusers model of this original)"
            ) from None
        if wrapped and place.kind != LINEAR:
            raise CheckpointError(
                f"{export.description}: Smooth wrapper name {name!r} on a non-Linear module"
            )
        if place.name in mapped:
            raise CheckpointError(
                f"{export.description}: tensors {mapped[place.name].export_name!r} and {name!r} "
                f"both map to {place.name!r}"
            )
        mapped[place.name] = ExportTensor(export.tensors[name], export.labels[name], name, wrapped, place)
    return mapped


def _parse_original_names(original: dict[str, TensorRef], names: ModelNames) -> dict[str, TensorName]:
    places = {}
    for tensor, ref in original.items():
        names.check_loaded(tensor, str(ref.path))
        try:
            places[tensor] = names.parse_diffusers(tensor)
        except CheckpointError:
            raise CheckpointError(
                f"{ref.path}: original tensor {tensor!r} is not in the Wan2.2 name table"
            ) from None
    return places


class MergeInputs:
    """One transformer's original and export, indexed by diffusers name and by Linear layer, and the
    checks between them; :meth:`decide_layers` runs them all."""

    def __init__(
        self,
        name: str,
        original_dir: Path,
        export: QuantExport,
        non_block: str,
        names: ModelNames,
        mxfp8: str = "keep",
    ):
        self.name = name
        self.original_dir = original_dir
        self.export = export
        self.non_block = non_block
        self.mxfp8 = mxfp8
        self.original = diffusers_archive(original_dir)
        self.names = names
        self.places = _parse_original_names(self.original, names)
        self.rotations = Rotations(export.description, names.attention)
        self.mapped = _map_export(export, self.rotations, names)
        self.by_layer: dict[str, dict[str, ExportTensor]] = {}
        for t in self.mapped.values():
            if t.place.layer is not None and t.place.kind == LINEAR:
                self.by_layer.setdefault(t.place.layer, {})[t.place.leaf] = t
        self.warnings: list[str] = []
        #: FLOAT tensors the export holds in another dtype with the original's exact values.
        self.same_values: set[str] = set()

    def warn(self, message: str) -> None:
        logger.warning("%s: %s", self.name, message)
        self.warnings.append(message)

    def _export_layer(self, layer: str) -> str:
        return self.names.diffusers_to_export(f"{layer}.weight")[: -len(".weight")]

    def _layer_context(self, layer: str) -> str:
        return f"{self.export.description.name}: layer {layer} (export {self._export_layer(layer)})"

    # Validation ------------------------------------------------------------------------------------

    def check_coverage(self) -> None:
        """Every export tensor has its counterpart in the original (for scales: its Linear)."""
        for t in self.mapped.values():
            if t.place.leaf in ADDED_LEAVES:
                if f"{t.place.layer}.weight" not in self.original:
                    raise _fail(
                        t.ref, "tensor", f"belongs to Linear {t.place.layer!r}, which the original lacks"
                    )
            elif t.place.name not in self.original:
                raise _fail(
                    t.ref, "tensor", f"maps to {t.place.name!r}, which the original transformer lacks"
                )

    def check_complete(self) -> None:
        """Every tensor of the original is in the export: msModelSlim saves the whole model (FLOAT or
        quantized), so a missing one means an incomplete export, never "take the original's"."""
        missing = [name for name in sorted(self.original, key=layer_order) if name not in self.mapped]
        if not missing:
            return
        name, layer = missing[0], self.places[missing[0]].layer
        if layer is not None and not any(t.place.layer == layer for t in self.mapped.values()):
            what = f"has no tensor of layer {layer} (export {self._export_layer(layer)})"
            others = [n for n in missing if self.places[n].layer != layer]
        else:
            what = f"lacks tensor {name} (export {self.names.diffusers_to_export(name)})"
            others = missing[1:]
        more = f", and {len(others)} other tensor(s) of the original" if others else ""
        raise CheckpointError(
            f"{self.export.description}: {what}{more}, which the original has; msModelSlim saves every "
            "tensor of the model, so the export is incomplete (re-export, or check that the weight files "
            "and the description belong together)"
        )

    def linear_layers(self) -> list[str]:
        layers = {p.layer for p in self.places.values() if p.kind == LINEAR and p.leaf == "weight"}
        return sorted(layers, key=layer_order)

    def check_smooth_wrapping(self, layer: str) -> None:
        """A Linear's export names are all Smooth-wrapped (with a ``mul_scale``) or all plain."""
        tensors = self.by_layer.get(layer, {})
        wrapped = {t.wrapped for t in tensors.values()}
        if len(wrapped) > 1:
            names = sorted(t.export_name for t in tensors.values())
            raise CheckpointError(
                f"{self._layer_context(layer)}: mixes Smooth-wrapped and plain tensor names {names}"
            )
        if wrapped == {True} and MUL_SCALE not in tensors:
            raise CheckpointError(
                f"{self._layer_context(layer)}: Smooth-wrapped tensors without "
                f"{self._export_layer(layer)}.div.mul_scale"
            )

    def layer_label(self, layer: str) -> str:
        """The description label of a Linear's weight (``FLOAT`` for a BF16 one)."""
        weight = self.by_layer.get(layer, {}).get("weight")
        return FLOAT_LABEL if weight is None else weight.label

    def layer_format(self, layer: str) -> str:
        """The format of :mod:`vllm_omni_mxfp4.spec` a quantized Linear is stored in."""
        return LAYER_FORMATS[self.layer_label(layer)]

    def exported_quantized(self, layer: str) -> bool:
        """Whether the export holds a quantized weight for this Linear."""
        weight = self.by_layer.get(layer, {}).get("weight")
        return weight is not None and weight.label != FLOAT_LABEL

    def check_bf16_layer(self, layer: str) -> None:
        """A Linear the export keeps in BF16 carries no scales and no Smooth vector."""
        tensors = self.by_layer.get(layer, {})
        context = self._layer_context(layer)
        scales = [leaf for leaf in _SCALE_LEAVES if leaf in tensors]
        if scales and "weight" not in tensors:
            raise CheckpointError(f"{context}: quantized layer is missing its weight tensor")
        if scales:
            raise CheckpointError(f"{context}: labelled FLOAT but has {', '.join(scales)}")
        pair = [leaf for leaf in PAIR_LEAVES if leaf in tensors]
        if pair:
            raise CheckpointError(
                f"{context}: kept in BF16 (its weight is labelled FLOAT) but carries a low-rank pair "
                f"({', '.join(tensors[leaf].export_name for leaf in pair)}); a BF16 Linear has its whole weight, "
                "and the pair would be added twice. Exclude the layer from msModelSlim's svd_res step, or "
                "quantize it too, and re-export"
            )
        if MUL_SCALE in tensors:
            raise CheckpointError(
                f"{context}: kept in BF16 but carries a Smooth scale ({tensors[MUL_SCALE].export_name}); "
                "a BF16 Linear does not apply mul_scale at runtime, so its smoothed weight would be wrong"
            )

    def _original_linear_shape(self, layer: str) -> tuple[int, int]:
        original = self.original[f"{layer}.weight"]
        if len(original.shape) != 2:
            raise CheckpointError(
                f"{self._layer_context(layer)}: the original weight has shape {list(original.shape)}, not 2-D"
            )
        return original.shape

    def _check_tensor_set(self, layer: str) -> None:
        """The quantized Linear has its format's tensors, labelled as msModelSlim labels them, and no others."""
        tensors = self.by_layer[layer]
        context = self._layer_context(layer)
        label = self.layer_label(layer)
        records = self.layer_records(layer)
        for record in records:
            t = tensors.get(record.name)
            allowed = _allowed_labels(record.name, label, self.export.saver)
            if t is not None and t.label not in allowed:
                expected = " or ".join(allowed)
                raise _fail(t.ref, record.name, f"is labelled {t.label}; expected {expected}")
            if t is None and record.required and record.name != MUL_SCALE:
                raise CheckpointError(
                    f"{context}: quantized ({label}) but {self._export_layer(layer)}.{record.name} is missing"
                )
        known = [record.name for record in records]
        for leaf, t in tensors.items():
            if leaf not in known:
                raise _fail(
                    t.ref, "tensor", f"is unexpected in a {label} layer, which has {', '.join(known)}"
                )
        has_bias = f"{layer}.bias" in self.original
        if has_bias and "bias" not in tensors:
            raise CheckpointError(f"{context}: the original has a bias but the export has none")
        if "bias" in tensors and not has_bias:
            raise _fail(tensors["bias"].ref, "bias", "exists but the original Linear has no bias")

    def layer_rank(self, layer: str) -> int:
        """The rank of a Linear's stored low-rank pair (rows of ``svd_lowrank_l1``); 0 without one."""
        l1 = self.by_layer.get(layer, {}).get(spec.LOW_RANK_L1)
        return int(l1.ref.shape[0]) if l1 is not None and len(l1.ref.shape) == 2 else 0

    def layer_records(self, layer: str) -> tuple[spec.CheckpointTensor, ...]:
        """The checkpoint tensors of a quantized Linear: its format's, and the low-rank pair's where its
        label is an SVD one (``W4A4_MXFP4_SVD``)."""
        records = spec.checkpoint_tensors(self.layer_format(layer))
        if self.layer_label(layer) in SVD_LABELS:
            records = (*records, *spec.low_rank_tensors(max(self.layer_rank(layer), 1)))
        return records

    def check_low_rank_scope(self, layer: str) -> None:
        """A stored pair sits on a Linear labelled ``_SVD`` (and back), and never next to a Smooth vector.

        msModelSlim's ``svd_res`` with a non-fusion Smooth on the same Linear writes a model whose branch
        and residual disagree: with the Smooth step first, the wrapper applies the branch to the raw input
        but decomposed the smoothed weight; with ``svd_res`` first, it applies the branch to the smoothed
        input but decomposed the unsmoothed weight (``SVDResidualWrapper`` and
        ``NonFusionSmoothQuantWrapper`` nest in the order their hooks were registered). Either way the
        Linear no longer computes the original, so the combination is refused."""
        tensors = self.by_layer.get(layer, {})
        pair = [leaf for leaf in PAIR_LEAVES if leaf in tensors]
        if not pair:
            if self.layer_label(layer) in SVD_LABELS:
                raise CheckpointError(
                    f"{self._layer_context(layer)}: labelled {self.layer_label(layer)} (a residual next to a "
                    f"low-rank pair), but {self._export_layer(layer)}.{spec.LOW_RANK_L1}/{spec.LOW_RANK_L2} are "
                    "missing: without the pair the residual alone is not the layer; re-export with msModelSlim's "
                    "ascendv1 saver (it writes the pair)"
                )
            return
        if MUL_SCALE in tensors:
            raise CheckpointError(
                f"{self._layer_context(layer)}: carries a low-rank pair and a Smooth scale "
                f"({tensors[MUL_SCALE].export_name}). msModelSlim nests its svd_res and Smooth wrappers so that "
                "the branch sees one input and was decomposed from the other weight (Smooth before svd_res: the "
                "branch gets the raw input but holds the smoothed weight; svd_res first: the reverse), so this "
                "Linear does not compute the original. Exclude the layer from one of the two steps and re-export"
            )
        if self.exported_quantized(layer) and self.layer_label(layer) not in SVD_LABELS:
            raise CheckpointError(
                f"{self._layer_context(layer)}: carries a low-rank pair but is labelled "
                f"{self.layer_label(layer)}; msModelSlim labels a Linear with a pair {self.layer_label(layer)}_SVD "
                "(the description was edited, or the pair belongs to other weights): export again"
            )

    def check_quantized_layer(self, layer: str) -> None:
        """A quantized Linear's tensors against the format's table: set, labels, dtypes, shapes, values."""
        n, k = self._original_linear_shape(layer)
        self._check_tensor_set(layer)
        records = self.layer_records(layer)
        rank = self.layer_rank(layer)
        if rank > spec.max_low_rank(n, k):
            raise _fail(
                self.by_layer[layer][spec.LOW_RANK_L1].ref,
                spec.LOW_RANK_L1,
                f"has rank {rank}, above min(N, K) = {spec.max_low_rank(n, k)} of the original Linear {layer} of shape "
                f"[{n}, {k}]: a low-rank pair has at most that rank (msModelSlim's svd_res refuses it); the pair "
                "belongs to another layer or the file is corrupt",
            )
        if k % records[0].k_per_index:
            raise CheckpointError(
                f"{self._layer_context(layer)}: K = {k} is odd and cannot hold packed FP4 pairs"
            )
        why = f"for the original Linear {layer} of shape [{n}, {k}]"
        tensors = self.by_layer[layer]
        for record in records:
            if record.name in tensors:
                self._check_written_dtype(layer, tensors[record.name].ref, record.name)
                check_record(tensors[record.name].ref, record, record.shape(n, k), why)

    def _check_written_dtype(self, layer: str, ref: TensorRef, leaf: str) -> None:
        """A float tensor of a quantized Linear has the dtype msModelSlim writes for its role
        (:func:`written_dtype`): a header relabelled to another float dtype reads the same bytes as
        other numbers, which no value rule can tell."""
        expected = written_dtype(leaf, self.original[f"{layer}.weight"].dtype)
        if expected is None or ref.dtype == expected or ref.dtype not in spec.FLOAT_DTYPES:
            return  # a non-float dtype is the table's check (check_record) to word
        raise _fail(
            ref,
            leaf,
            f"has dtype {ref.dtype}; expected {expected}, the dtype msModelSlim writes {WRITTEN_DTYPES[leaf]}. A "
            "header relabelled to another float dtype reads the same bytes as other numbers: export again "
            "with msModelSlim (or restore the file it wrote)",
        )

    def keeps_quantized(self, layer: str) -> bool:
        """Whether a quantized Linear is written quantized: block Linears are (W8A8 MXFP8 ones unless
        the ``mxfp8`` policy is ``bf16``); for the others the ``non_block`` policy either refuses the
        export or takes the BF16 original."""
        if self.names.is_runtime_quantizable(layer):
            return self.mxfp8 == "keep" or self.layer_format(layer) != MXFP8
        if self.non_block == "error":
            raise CheckpointError(
                f"{self._layer_context(layer)}: is quantized, but vLLM-Omni runs this Linear in BF16 "
                f"(its {self.names.model_class} builds it without a quantization config); exclude it from "
                "quantization in msModelSlim or pass --non-block-quantized original"
            )
        self.warn(f"{layer} is quantized in the export; its BF16 original is used instead")
        return False

    def _smooth_vector(self, layer: str) -> np.ndarray | None:
        smooth = self.by_layer[layer].get(MUL_SCALE)
        return None if smooth is None else smooth.ref.read_array().astype(np.float32)

    def fused_groups(self) -> dict[str, list[str]]:
        """The diffusers Linears the model fuses, by runtime Linear, in piece order (from the model's
        own loader: Wan's ``attn1.to_qkv``, Qwen-Image's ``attn.to_qkv`` and ``attn.add_kv_proj``)."""
        groups: dict[str, list[tuple[int, str]]] = {}
        for layer in self.linear_layers():
            piece = self.names.fused_piece(layer)
            if piece is not None:
                groups.setdefault(piece[0], []).append((piece[1], layer))
        return {runtime: [layer for _, layer in sorted(members)] for runtime, members in groups.items()}

    def check_fused_qkv(self, layers: Layers) -> None:
        """Linears the model fuses into one share one precision, format and ``mul_scale``."""
        quantized = set(layers.quantized)
        for group, members in self.fused_groups().items():
            export = self._export_layer(members[0]).rsplit(".", 1)[0]
            context = f"{self.export.description.name}: fused {group} (export {export})"
            short = [layer.rsplit(".", 1)[1] for layer in members]
            done = [s for s, layer in zip(short, members) if layer in quantized]
            formats = {self.layer_label(layer) for layer in members if layer in quantized}
            if len(formats) > 1:
                shown = ", ".join(f"{s} {self.layer_label(m)}" for s, m in zip(short, members))
                raise CheckpointError(
                    f"{context}: {'/'.join(short)} are stored in different formats ({shown}); vLLM-Omni "
                    f"fuses them into {group}, one Linear of one format: quantize them alike"
                )
            if done and len(done) != len(members):
                bf16 = [s for s, layer in zip(short, members) if layer not in quantized]
                raise CheckpointError(
                    f"{context}: partial BF16 fallback ({', '.join(done)} quantized, {', '.join(bf16)} BF16); "
                    f"vLLM-Omni fuses {', '.join(short)} into {group}, so all must share one precision"
                )
            if done:
                self._check_shared_smooth(context, members, short)
                ranks = [self.layer_rank(layer) for layer in members]
                if len(set(ranks)) > 1:
                    shown = ", ".join(f"{s} rank {r}" for s, r in zip(short, ranks))
                    raise CheckpointError(
                        f"{context}: {'/'.join(short)} have low-rank pairs of different ranks ({shown}); vLLM-Omni "
                        f"fuses them into {group}, whose pieces share one rank: run svd_res on them with one rank"
                    )

    def _check_shared_smooth(self, context: str, members: list[str], short: list[str]) -> None:
        values = [self._smooth_vector(layer) for layer in members]
        if any(v is None for v in values) and not all(v is None for v in values):
            with_smooth = [s for s, v in zip(short, values) if v is not None]
            raise CheckpointError(
                f"{context}: Smooth mul_scale on {', '.join(with_smooth)} only; {'/'.join(short)} share one"
            )
        if values[0] is not None and not all(np.array_equal(values[0], v) for v in values[1:]):
            raise CheckpointError(
                f"{context}: {'/'.join(short)} have different mul_scale tensors; the fused Linear applies one"
            )

    def check_float_tensors(self, layers: Layers) -> None:
        """Export tensors outside the quantized Linears are FLOAT, with the original's dtype and shape,
        and finite; so are the original tensors that replace a quantized non-block Linear."""
        quantized = set(layers.quantized)
        for name in sorted(self.original, key=layer_order):
            place, t, original = self.places[name], self.mapped.get(name), self.original[name]
            if place.layer in layers.replaced:
                check_streamed_values(original, "original tensor")
                continue
            if t is None or place.layer in quantized:
                continue
            if t.label != FLOAT_LABEL:
                raise _fail(t.ref, "tensor", f"is labelled {t.label} but is not part of a quantized Linear")
            _check_dtype_and_shape(
                t, "FLOAT tensor", spec.FLOAT_DTYPES, original.shape, f"(the original {name})"
            )
            check_streamed_values(t.ref, "FLOAT tensor")
            if t.ref.dtype != original.dtype:
                self._check_other_dtype(t, original)

    def _check_other_dtype(self, t: ExportTensor, original: TensorRef) -> None:
        """A FLOAT tensor stored in another dtype than the original's is refused unless it holds
        exactly the original's numbers (a lossless cast); the merge then writes the original's bytes."""
        diff = first_difference(t.ref, original)
        if diff is not None:
            at, exported, value = diff
            raise _fail(
                t.ref,
                "FLOAT tensor",
                f"has dtype {t.ref.dtype}, but the original {original.name} is {original.dtype}, and the "
                f"values differ (at {at}: {exported} in the export, {value} in the original); an "
                "unquantized tensor must be the original's: export from this original in its own dtype",
            )
        self.same_values.add(original.name)

    def decide_layers(self) -> Layers:
        """Validate the export against the original and decide how each Linear is written."""
        self.check_coverage()
        layers = Layers()
        for layer in self.linear_layers():
            self.check_low_rank_scope(layer)
            self.check_smooth_wrapping(layer)
            if not self.exported_quantized(layer):
                self.check_bf16_layer(layer)
            else:
                self.check_quantized_layer(layer)
                if self.keeps_quantized(layer):
                    layers.quantized.append(layer)
                    continue
                layers.replaced.add(layer)
            layers.bf16.append(layer)
        layers.mxfp8 = [layer for layer in layers.quantized if self.layer_format(layer) == MXFP8]
        self.check_complete()
        self.check_fused_qkv(layers)
        self.check_float_tensors(layers)
        self.check_rotations()
        return layers

    def check_rotations(self) -> None:
        """Online Q/K rotation records: well formed, and the Q/K weights they rotate are unrotated."""
        decoded = {}
        for owner in self.rotations.records:
            for layer in self.names.attention(owner)[1]:
                decoded[self._export_layer(layer)] = (
                    self._decoded_rows(layer),
                    read_rows(self.original[f"{layer}.weight"], ROWS_COMPARED).astype(np.float64),
                )
        self.rotations.check(self.original_dir, decoded)

    def _decoded_rows(self, layer: str) -> np.ndarray:
        """The first rows of a Linear's weight as the export stores it, decoded to numbers."""
        tensors = self.by_layer[layer]
        weight, scale = tensors["weight"].ref, tensors.get("weight_scale")
        fmt = "bf16" if not self.exported_quantized(layer) else self.layer_format(layer)
        values = decode_rows(fmt, weight, None if scale is None else scale.ref, ROWS_COMPARED)
        dual = tensors.get("weight_dual_scale")
        if dual is not None:
            coarse = read_rows(dual.ref, ROWS_COMPARED)[..., 0].astype(np.float64)
            values = values * np.repeat(coarse, spec.DUAL_BLOCK, axis=1)[:, : values.shape[1]]
        smooth = tensors.get(MUL_SCALE)
        return values if smooth is None else values * smooth.ref.read_array().astype(np.float64)
