"""The low-rank branch of a quantized Linear: parameters, loading (computed or stored), forward.

With ``svd_rank: r`` an online layer keeps, next to its quantized weight, a pair per fused part
(:mod:`vllm_omni_mxfp4.formats.low_rank`): ``svd_lowrank_l1`` ``(parts * r, K)`` holds each part's
``L1`` one under the other, ``svd_lowrank_l2`` ``(N, r)`` each part's ``L2`` in the part's output
rows. Both are parameters in the activation dtype, so vLLM-Omni's offload and sleep movers move them
with the layer.

Two sources of the pair:

- online ``svd_rank: r``: computed at load from each BF16 weight piece (below);
- offline ``svd_lowrank_layers: {layer: r}``: stored in the checkpoint next to the quantized residual
  (msModelSlim's ``svd_res`` export, merged), one pair per checkpoint Linear, checked against
  :func:`vllm_omni_mxfp4.spec.low_rank_tensors` (shape, dtype, finite values) as it loads.

Loading (online): each BF16 weight piece (a whole Linear, or the Q, K or V of a fused one) arrives complete
from the checkpoint, before vLLM narrows it to this TP rank. Its pair is computed there, from the
whole piece, and the piece's residual ``W - L2 @ L1`` goes on to the normal online path (narrowed,
quantized). Every rank therefore holds the slices of the same pair and the same residual as TP=1:
a column-parallel rank keeps its output rows of ``L2`` and all of ``L1``, a row-parallel rank its
K columns of ``L1`` and all of ``L2``, whose partial products join the main path's all-reduce.

Forward: ``y = kernel(x) + (x L1^T) L2^T`` per part, in the activation dtype, on the activation as the
layer receives it, before any Smooth: msModelSlim's ``SVDResidualWrapper`` computes
``wrapped(x) + F.linear(F.linear(x, l1), l2)`` with the same two ``F.linear`` calls per Linear, and
its export keeps Smooth-wrapped layers out of the branch's scope (the merge refuses the combination). The branch does not depend on the precision of the
step, so W4A8 layers and steps keep it, and it runs outside the kernel: every backend gets the same
branch.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.model_executor.layers.linear import RowParallelLinear
from vllm.model_executor.utils import set_weight_attrs

from .. import spec
from ..formats.dtypes import safetensors_name
from ..formats.low_rank import split_weight
from ..spec import LOW_RANK_L1, LOW_RANK_L2
from .loading import check_values, counted_load

logger = logging.getLogger(__name__)

QKV_PIECES = ("q", "k", "v")


def piece_sizes(layer: torch.nn.Module, output_size: int) -> list[int]:
    """Output rows of each checkpoint piece of ``layer`` over all ranks: Q, K and V of a fused
    attention projection, the parts of a merged Linear, or the one weight of any other Linear."""
    if hasattr(layer, "total_num_kv_heads"):  # QKVParallelLinear
        kv = layer.total_num_kv_heads
        return [layer.total_num_heads * layer.head_size, kv * layer.head_size, kv * layer.v_head_size]
    sizes = getattr(layer, "output_sizes", None)
    return list(sizes) if sizes and len(sizes) > 1 else [output_size]


def piece_index(layer: torch.nn.Module, shard: tuple[Any, ...]) -> int | None:
    """Which piece a loader call carries (``None``: all pieces fused in one checkpoint tensor)."""
    shard_id = shard[0] if shard else None
    if shard_id is None:
        return None if len(layer.logical_widths) > 1 else 0
    if isinstance(shard_id, str):
        return QKV_PIECES.index(shard_id)
    return int(shard_id)


def check_rank(
    prefix: str, method: str, rank: int, pieces: list[int], k_full: int, *, stored: bool = False
) -> None:
    """Refuse, before any allocation, a rank that some piece ``(N_piece, K)`` cannot have."""
    smallest = spec.max_low_rank(pieces, k_full)
    if rank > smallest:
        shapes = ", ".join(f"({n}, {k_full})" for n in pieces)
        what = f"svd_lowrank_layers gives rank {rank}, which" if stored else f"svd_rank {rank}"
        fix = (
            "the checkpoint's config is corrupt or belongs to another model: export it again (vllm-omni-mxfp4 merge)"
            if stored
            else f"use svd_rank <= {smallest}, or list the layer in ignored_layers"
        )
        raise ValueError(
            f"{prefix}: {what} exceeds min(N, K) = {smallest} of its weight{'s' if len(pieces) > 1 else ''} "
            f"{shapes} ({method}); {fix}"
        )


def create(
    layer: torch.nn.Module,
    prefix: str,
    method: str,
    rank: int,
    output_size: int,
    *,
    stored: bool = False,
    vllm_loader=None,
) -> None:
    """Register the pair's parameters on a layer being created (zeros until loaded).

    Online (``stored`` false) the pair is computed from the weight, so checkpoint pairs are refused;
    offline it is the checkpoint's, loaded through :func:`load_stored` and required."""
    pieces = piece_sizes(layer, output_size)
    check_rank(prefix, method, rank, pieces, layer._mx.geometry.k_full, stored=stored)
    dtype = layer.orig_dtype
    n, k = layer.output_size_per_partition, layer.input_size_per_partition
    shapes = {LOW_RANK_L1: (len(layer.logical_widths) * rank, k), LOW_RANK_L2: (n, rank)}
    for name, shape in shapes.items():
        param = Parameter(torch.zeros(shape, dtype=dtype, device=layer._mx.load_device), requires_grad=False)
        layer.register_parameter(name, param)
        if stored:
            # required, but checked by the layer (MxLinearMethod._check_complete names the key), not by vLLM
            attrs = {
                "weight_loader": _stored_loader(layer, prefix, name, rank, pieces, vllm_loader),
                "is_checkpoint_optional": True,
                "required_by": "svd_lowrank_layers lists the layer",
            }
        else:

            def refuse(param: Parameter, loaded_weight: torch.Tensor, *shard: Any, _name: str = name) -> None:
                raise ValueError(
                    f"{prefix}.{_name}: the checkpoint carries its own low-rank pair, and svd_rank {rank} would "
                    f"compute a second one from the weight at load. Remove svd_rank from the {method} config."
                )

            # computed from the weight, never read from the checkpoint: not expected there by the loader
            attrs = {"weight_loader": refuse, "ignore_warning": True, "is_checkpoint_optional": True}
        set_weight_attrs(param, attrs)
    set_weight_attrs(layer.svd_lowrank_l2, {"output_dim": 0})
    layer._mx.low_rank = rank


def _stored_loader(layer: torch.nn.Module, prefix: str, name: str, rank: int, pieces: list[int], vllm_loader):
    """The weight loader of a stored pair tensor: checked against its record, stored per piece."""
    record = spec.low_rank_tensors(rank)[0 if name == LOW_RANK_L1 else 1]

    def load(param: Parameter, loaded_weight: torch.Tensor, *shard: Any) -> None:
        index = piece_index(layer, shard)
        where = f"{prefix}.{name}" + (
            f" (fused piece {shard[0]!r})" if shard and shard[0] is not None else ""
        )
        n_piece = sum(pieces) if index is None else pieces[index]
        expected = record.shape(n_piece, layer._mx.geometry.k_full)
        problem = spec.tensor_problem(
            record, safetensors_name(loaded_weight.dtype), tuple(loaded_weight.shape), expected, None
        )
        if problem is not None:
            raise ValueError(
                f"{where}: {problem} (svd_lowrank_layers gives {prefix} rank {rank}); export the checkpoint "
                "again (vllm-omni-mxfp4 merge checks each pair)"
            )
        check_values(where, record.value_rule, loaded_weight)

        def copy(target: torch.Tensor) -> None:
            if index is not None:
                _store(layer, name, index, loaded_weight, shard, vllm_loader)
            elif name == LOW_RANK_L1:  # one pair for a fused-on-disk weight: every piece shares L1
                for i in range(len(pieces)):
                    _store(layer, name, i, loaded_weight, (), vllm_loader)
            else:
                vllm_loader(target, loaded_weight.to(target.dtype))

        counted_load(layer._mx, layer, name, copy)

    return load


def _store(layer: torch.nn.Module, name: str, index: int, t: torch.Tensor, shard: tuple, vllm_loader) -> None:
    """This rank's slice of piece ``index``'s ``L1`` (rows ``index * r``, a row-parallel rank's K
    columns) or ``L2`` (through vLLM's loader: a column-parallel rank's output rows)."""
    param = getattr(layer, name)
    if name == LOW_RANK_L2:
        vllm_loader(param, t.to(param.dtype), *shard)
        return
    rank, geometry = layer._mx.low_rank, layer._mx.geometry
    if isinstance(layer, RowParallelLinear) and geometry.sharded:
        t = t[:, geometry.k0 : geometry.k0 + geometry.k]
    param.data[index * rank : (index + 1) * rank].copy_(t.to(param.dtype))


def split_on_load(
    layer: torch.nn.Module, prefix: str, weight: torch.Tensor, shard: tuple[Any, ...], vllm_loader
) -> torch.Tensor:
    """Store this rank's slices of the pair of the checkpoint piece(s) in ``weight`` and return the
    residual that the online path loads in its place."""
    index = piece_index(layer, shard)
    if index is None:  # Q, K and V fused in one checkpoint tensor: split it as vLLM does
        sizes = piece_sizes(layer, weight.shape[0])
        ids = QKV_PIECES if hasattr(layer, "total_num_kv_heads") else range(len(sizes))
        pieces = torch.split(weight, sizes, dim=0)
        return torch.cat([split_on_load(layer, prefix, p, (i,), vllm_loader) for p, i in zip(pieces, ids)])
    rank = layer._mx.low_rank
    where = f"{prefix}.weight" + (f" (fused piece {shard[0]!r})" if shard and shard[0] is not None else "")
    l1, l2, residual = split_weight(weight, rank, where)
    _store(layer, LOW_RANK_L1, index, l1, shard, vllm_loader)
    _store(layer, LOW_RANK_L2, index, l2, shard, vllm_loader)
    return residual


def apply(layer: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out + (x L1^T) L2^T`` for each piece, in ``x``'s dtype (``x`` (M, K), ``out`` (M, N))."""
    rank = layer._mx.low_rank
    l1, l2 = layer.svd_lowrank_l1.to(x.dtype), layer.svd_lowrank_l2.to(x.dtype)
    widths = layer.logical_widths
    if len(widths) == 1:
        return out + F.linear(F.linear(x, l1), l2)
    branch, row = [], 0
    for i, width in enumerate(widths):
        branch.append(F.linear(F.linear(x, l1[i * rank : (i + 1) * rank]), l2[row : row + width]))
        row += width
    return out + torch.cat(branch, dim=-1)
