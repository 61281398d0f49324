"""Each runtime Linear against the checkpoint tensors that feed it (pure Python and numpy).

The model walk (:mod:`.model`) says where the model's own loader puts every checkpoint tensor;
here each runtime Linear gets the tensors that land in it (and those of the same checkpoint module
that its loader skips: scales of a Linear that runs in BF16), and they are checked against what
the Linear's method loads:

- a quantized offline Linear: the format's tensors of :func:`vllm_omni_mxfp4.spec.checkpoint_tensors`
  per fused piece (and the low-rank pair of :func:`vllm_omni_mxfp4.spec.low_rank_tensors` where
  ``svd_lowrank_layers`` lists the Linear), with their dtypes, shapes (from the piece's ``(N, K)``) and value rules (read in
  bounded chunks; packed FP4 bytes are not read), ``mul_scale`` required where the format or
  ``require_smooth_scale`` requires it, a bias exactly where the model's Linear has one, and fused
  pieces that agree on Smooth;
- a Linear that loads a floating-point weight (BF16, or quantized online): a floating weight of the
  piece's shape and no scales. A packed FP4 weight there is a quantized layer that the config or
  the model keeps in BF16.

Every problem names the checkpoint tensor, what was expected and what was found.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from vllm_omni_mxfp4 import spec
from vllm_omni_mxfp4.config import QuantConfig
from vllm_omni_mxfp4.config.keys import layer_order
from vllm_omni_mxfp4.safetensors_io import CODE_DTYPES, TensorRef, first_bad_value

from ..models.records import ModelWalk, RuntimeLinear
from .report import LayerRow, TensorRow

WEIGHT = spec.WEIGHT_FP4.name
MUL_SCALE = spec.MUL_SCALE.name
BIAS = spec.BIAS.name


@dataclass(frozen=True)
class Feed:
    """A checkpoint tensor that belongs to a runtime Linear: its role there (the parameter it
    loads into, or its own leaf name when the loader skips it), its fused piece and the checkpoint
    module it comes from."""

    ref: TensorRef
    role: str
    piece: int | None
    source: str


def attribute(walk: ModelWalk, archive: Mapping[str, TensorRef]) -> tuple[dict[str, list[Feed]], list[str]]:
    """The feeds of each runtime Linear, by name, and the tensors that feed no Linear and that the
    model's loader does not place either (it skips them)."""
    linears = {lin.name: lin for lin in walk.linears}
    module_of: dict[str, tuple[str, int | None]] = {}
    feeds: dict[str, list[Feed]] = defaultdict(list)
    for name, placement in walk.placements.items():
        layer, _, role = (placement.param or "").rpartition(".")
        if layer in linears:
            piece = linears[layer].piece(placement.shard)
            source = name.rpartition(".")[0]
            module_of[source] = (layer, piece)
            feeds[layer].append(Feed(archive[name], role, piece, source))
    skipped = []
    for name in sorted(archive, key=layer_order):
        if name in walk.placements:
            continue
        source, _, role = name.rpartition(".")
        if source in module_of:
            layer, piece = module_of[source]
            feeds[layer].append(Feed(archive[name], role, piece, source))
        else:
            skipped.append(name)
    for found in feeds.values():  # fused pieces in their order (q, k, v), each piece's tensors together
        found.sort(key=lambda f: -1 if f.piece is None else f.piece)
    return feeds, skipped


def _check_record(feed: Feed, record: spec.CheckpointTensor, n: int, k: int) -> list[str]:
    """dtype, shape and values of one Linear's tensor against its spec record (the merge's and the
    loader's check, :func:`vllm_omni_mxfp4.spec.tensor_problem`; values read in bounded chunks)."""
    ref = feed.ref
    problem = spec.tensor_problem(
        record, ref.dtype, ref.shape, record.shape(n, k), lambda rule: first_bad_value(ref, lambda v: rule.bad(v, np)),
        codes=ref.dtype in CODE_DTYPES,
    )  # fmt: skip
    return [f"{ref.name}: {problem} for N={n}, K={k}"] if problem else []


def _source_name(lin: RuntimeLinear, piece: int | None, feeds: list[Feed], packed: Mapping) -> str:
    """The checkpoint module of a piece: from its tensors, else the model's packed mapping, else the
    runtime name."""
    for feed in feeds:
        if feed.piece == piece:
            return feed.source
    head, _, last = lin.name.rpartition(".")
    if piece is not None and last in packed and piece < len(packed[last]):
        return f"{head}.{packed[last][piece]}" if head else packed[last][piece]
    return lin.name


def _pieces(lin: RuntimeLinear) -> list[tuple[int | None, int]]:
    """``(piece, rows)`` of each fused piece, or ``[(None, N)]``."""
    if not lin.fused:
        return [(None, lin.out_sizes[0])]
    return list(enumerate(lin.out_sizes))


def _required(record: spec.CheckpointTensor, lin: RuntimeLinear, quant: QuantConfig) -> bool:
    if record.name == BIAS:
        return lin.has_bias
    if record.name == MUL_SCALE and getattr(quant, "require_smooth_scale", False):
        return True
    return record.required


def _layout(record: spec.CheckpointTensor, feed: Feed) -> spec.CheckpointTensor:
    """The record of the layout a quantized Linear's tensor is stored in: an FP4 weight in a float
    dtype is the numeric layout (E2M1 values, ``merge --weight-layout numeric``), which the loader packs."""
    if record is spec.WEIGHT_FP4 and feed.ref.dtype in spec.WEIGHT_FP4_NUMERIC.dtypes:
        return spec.WEIGHT_FP4_NUMERIC
    return record


def _check_quantized(lin: RuntimeLinear, feeds: list[Feed], quant: QuantConfig, packed: Mapping) -> list[str]:
    """An offline quantized Linear: per piece, the format's tensors (set, dtypes, shapes, values)."""
    records = {record.name: record for record in spec.checkpoint_tensors(lin.method)}
    rank = quant.svd_lowrank_layers.get(lin.name, 0)
    problems = []
    if rank:  # (a rank above min(N, K) fails the model build, which the walk reports)
        records.update({record.name: record for record in spec.low_rank_tensors(rank)})
    for piece, n in _pieces(lin):
        got = {f.role: f for f in feeds if f.piece == piece}
        source = _source_name(lin, piece, feeds, packed)
        for role, feed in got.items():
            if role in (spec.LOW_RANK_L1, spec.LOW_RANK_L2) and not rank:
                problems.append(
                    f"{feed.ref.name}: a low-rank pair, but svd_lowrank_layers does not list {lin.name}, so the "
                    "loader has no branch to put it in; list the layer with its rank (the merge writes the list)"
                )
            elif role not in records:
                problems.append(
                    f"{feed.ref.name}: {role} is not a tensor of a {lin.method} Linear (it has {', '.join(records)})"
                )
            elif role == BIAS and not lin.has_bias:
                problems.append(f"{feed.ref.name}: a bias, but the model's Linear has none")
            else:
                problems.extend(_check_record(feed, _layout(records[role], feed), n, lin.in_features))
        for record in records.values():
            if record.name not in got and _required(record, lin, quant):
                problems.append(
                    f"{source}.{record.name}: missing; an offline {lin.method} Linear loads "
                    f"{record.describe()}"
                )
    return problems + _check_fused_smooth(lin, feeds)


def _check_fused_smooth(lin: RuntimeLinear, feeds: list[Feed]) -> list[str]:
    """The pieces of a fused Linear carry one Smooth vector (all or none, equal values)."""
    smooth = {f.piece: f for f in feeds if f.role == MUL_SCALE}
    if not lin.fused or not smooth:
        return []
    if len(smooth) != len(lin.out_sizes):
        names = ", ".join(f.ref.name for f in smooth.values())
        return [f"{names}: Smooth on some fused pieces only; the fused Linear applies one mul_scale to all"]
    first, *others = smooth.values()
    values = first.ref.read_array()
    for other in others:
        if other.ref.shape == first.ref.shape and not np.array_equal(values, other.ref.read_array()):
            return [
                f"{other.ref.name}: differs from {first.ref.name}; the fused Linear applies one mul_scale"
            ]
    return []


def _bf16_fix(lin: RuntimeLinear, quant: QuantConfig | None) -> str:
    """Why a Linear loads a floating-point weight, and what to do about a packed one."""
    if lin.kind == "plain":
        return (
            "vLLM-Omni builds this Linear as a plain nn.Linear, which runs in BF16 only: keep it BF16 in "
            "the checkpoint (merge: --non-block-quantized original)"
        )
    if quant is None:
        return "config.json has no quantization_config: add the one the merge writes"
    if lin.method == "bf16" and lin.reason == "listed in ignored_layers":
        return "a quantized layer listed as ignored: remove it from ignored_layers in config.json"
    if lin.method == "bf16":
        return f"this Linear runs in BF16 ({lin.reason}); keep it BF16 in the checkpoint"
    return f"the {quant.METHOD} config is online (it quantizes BF16 weights at load); set its serialized flag"


def _check_float(
    lin: RuntimeLinear, feeds: list[Feed], quant: QuantConfig | None, packed: Mapping
) -> list[str]:
    """A Linear that loads a floating-point weight: one per piece, of the piece's shape, no scales."""
    problems = []
    for piece, n in _pieces(lin):
        got = {f.role: f for f in feeds if f.piece == piece}
        weight = got.get(WEIGHT)
        if weight is None:
            source = _source_name(lin, piece, feeds, packed)
            problems.append(
                f"{source}.weight: missing; this Linear loads a BF16 weight of shape [{n}, {lin.in_features}]"
            )
        elif weight.ref.dtype not in spec.FLOAT_DTYPES:
            problems.append(
                f"{weight.ref.name}: {weight.ref.dtype} {list(weight.ref.shape)}, a packed quantized weight, where "
                f"a BF16 weight of shape [{n}, {lin.in_features}] is loaded; {_bf16_fix(lin, quant)}"
            )
        elif tuple(weight.ref.shape) != (n, lin.in_features):
            problems.append(
                f"{weight.ref.name}: shape {list(weight.ref.shape)}; expected [{n}, {lin.in_features}]"
            )
        for role, feed in got.items():
            if role == BIAS:
                problems.extend(_check_record(feed, spec.BIAS, n, lin.in_features))
            elif role != WEIGHT:
                problems.append(
                    f"{feed.ref.name}: a {role} tensor for a Linear that loads a BF16 weight; {_bf16_fix(lin, quant)}"
                )
    return problems


def base_row(lin: RuntimeLinear, feeds: list[Feed]) -> LayerRow:
    """The row of one runtime Linear before any check: how it runs, the tensors that feed it."""
    row = LayerRow(
        lin.name, lin.kind, lin.method, lin.precision, lin.reason, (sum(lin.out_sizes), lin.in_features)
    )
    row.tensors = [TensorRow(f.ref.name, f.role, f.ref.dtype, tuple(f.ref.shape), f.piece) for f in feeds]
    row.sources = list(dict.fromkeys(f.source for f in feeds))
    return row


def layer_row(lin: RuntimeLinear, feeds: list[Feed], quant: QuantConfig | None, packed: Mapping) -> LayerRow:
    """The row of one runtime Linear: how it runs, its tensors, its problems."""
    row = base_row(lin, feeds)
    if lin.method in spec.FORMATS and quant is not None and quant.is_serialized:
        if any(record.name == MUL_SCALE for record in spec.checkpoint_tensors(lin.method)):
            row.smooth = any(f.role == MUL_SCALE for f in feeds)  # None: the format has no Smooth
        row.problems = _check_quantized(lin, feeds, quant, packed)
    else:
        row.problems = _check_float(lin, feeds, quant, packed)
    return row
