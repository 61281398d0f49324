"""Loading a quantized Linear's checkpoint tensors: checks, conversion, sharding, completeness.

Every parameter of a quantized Linear gets a loader wrapper (:func:`make_loader`) that

- checks the checkpoint tensor against its record in :mod:`vllm_omni_mxfp4.spec` (shape from the
  table, value rule; errors name the tensor, what was expected and the fix) and converts numeric
  FP4 weights to packed bytes (:func:`checked_tensor`);
- slices a row-parallel shard's K range (:class:`~.state.ShardGeometry`, ``CheckpointTensor.k_slice``)
  or hands the tensor to vLLM's own loader (column shards, fused Q/K/V pieces);
- counts the elements written (:class:`CopyCounter`), so that the layer knows when a parameter is
  complete: fused Q/K/V arrive in three pieces, and an online weight is quantized the moment its
  last element arrives.

vLLM has a similar counter (``model_loader/reload/meta.CopyCounter``), but it counts every
``copy_`` of a loader call, not the copies into one parameter; ``copy_numel_counter`` is not in
the installed vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import Parameter
from torch.utils._python_dispatch import TorchDispatchMode

from .. import spec
from ..formats import e2m1_decode, e2m1_encode, pack_fp4
from ..formats.dtypes import safetensors_name
from ..kernels import SharedBlocks
from ..spec import FLOAT_DTYPES, CheckpointTensor, ValueRule
from .state import MxLayerState, Phase, ShardGeometry

logger = logging.getLogger(__name__)

_FLOATS = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)


#: The dtypes the loader accepts for each scale and Smooth tensor, wider than the stored dtypes the
#: table lists (another producer's float precision): float scales become float32 as they load.
_LOAD_DTYPES: dict[str, tuple[str, ...]] = {
    "weight_scale": ("U8",),  # float8_e8m0fnu is read as its codes first
    "weight_dual_scale": FLOAT_DTYPES,
    "mul_scale": FLOAT_DTYPES,
}


class CopyCounter(TorchDispatchMode):
    """Counts the elements copied into one storage while a loader runs.

    On entry it runs one op of its own and checks that it saw it: if something in the process has
    switched Python dispatch off (a leaked ``no_dispatch`` guard), every load would otherwise look
    incomplete ("0 of N elements were loaded")."""

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self.ptr = target.untyped_storage().data_ptr()
        self.count = 0
        self.ops = 0

    def __enter__(self) -> CopyCounter:
        super().__enter__()
        torch.zeros(1).add_(1)
        if not self.ops:
            super().__exit__(None, None, None)
            raise RuntimeError(
                "vllm-omni-mxfp4 counts the elements a loader writes with a torch dispatch mode, and this "
                "process does not run dispatch modes (Python dispatch is switched off in this thread, "
                "e.g. by a torch.utils._mode_utils.no_dispatch() left open); load in a fresh process"
            )
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func is torch.ops.aten.copy_.default and args[0].untyped_storage().data_ptr() == self.ptr:
            self.count += args[0].numel()
        return func(*args, **(kwargs or {}))


def shard_geometry(
    prefix: str, k: int, k_full: int, *, tp_rank: int, tp_size: int, block: int
) -> ShardGeometry:
    """The geometry of rank ``tp_rank``'s K shard of a row-parallel layer (``tp_size`` 1: unsharded)."""
    if tp_size <= 1:
        return ShardGeometry(k_full=k_full, k=k)
    k0 = tp_rank * k
    front, back = k0 % block, -(k0 + k) % block
    if front or back:
        logger.info(
            "%s: K=%d split over TP=%d gives %d per rank, not a multiple of %d; rank %d pads %d+%d zero "
            "inputs to line its blocks up with the checkpoint's, and the ranks agree on the shared blocks' "
            "activation maxima (one all-reduce MAX per forward)",
            prefix,
            k_full,
            tp_size,
            k,
            block,
            tp_rank,
            front,
            back,
        )
    return ShardGeometry(k_full=k_full, k=k, k0=k0, front=front, back=back, sharded=True)


def tp_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """All-reduce (MAX) of ``t`` over vLLM's tensor-parallel group, in place; returns ``t``."""
    from vllm.distributed.parallel_state import get_tp_group

    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().device_group)
    return t


def shared_blocks(
    prefix: str, geometry: ShardGeometry, tp_rank: int, tp_size: int, block: int
) -> SharedBlocks | None:
    """The blocks rank ``tp_rank`` shares with its neighbours (:class:`~..kernels.SharedBlocks`), whose
    activation maxima the ranks agree on over vLLM's TP group; None for an unsharded layer."""
    if not geometry.sharded:
        return None
    return SharedBlocks.of(prefix, geometry.k_full, tp_rank, tp_size, block, tp_reduce_max)


def row_shard(geometry: ShardGeometry, tensor: CheckpointTensor | None, t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a full checkpoint tensor of a row-parallel layer (``tensor`` None: the
    online BF16 weight), zero-filled past the end (a shard's last block past K)."""
    lo, hi = geometry.k_range(tensor)
    axis, (start, stop) = (1, (lo, hi)) if tensor is None else (tensor.k_axis, tensor.k_slice(lo, hi))
    have = t.narrow(axis, start, max(0, min(stop, t.shape[axis]) - start))
    if have.shape[axis] == stop - start:
        return have
    shape = list(t.shape)
    shape[axis] = stop - start - have.shape[axis]
    return torch.cat((have, t.new_zeros(shape)), dim=axis)


def checked_tensor(where: str, tensor: CheckpointTensor, t: torch.Tensor, k_full: int) -> torch.Tensor:
    """A checkpoint tensor checked against ``tensor``'s record for a checkpoint K of ``k_full``
    (any N: fused layers load theirs in pieces), in the parameter's layout (packed FP4 bytes, uint8
    E8M0 codes, float32 scales): the table's check (:func:`vllm_omni_mxfp4.spec.tensor_problem`)
    with the dtypes the loader converts, then the value rule."""
    if tensor.name == "weight":
        return as_packed(t, k_full, where)
    if tensor.name == "weight_scale" and t.dtype == getattr(torch, "float8_e8m0fnu", None):
        t = t.view(torch.uint8)
    has_n = tensor.shape(1, k_full) != tensor.shape(2, k_full)
    want = tensor.shape(t.shape[0] if has_n and t.dim() else 0, k_full)
    dtypes = _LOAD_DTYPES[tensor.name]
    problem = spec.tensor_problem(
        tensor, safetensors_name(t.dtype), tuple(t.shape), want, None, dtypes=dtypes
    )
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    check_values(where, tensor.value_rule, t)
    return t if t.dtype == torch.uint8 else t.float()


def check_values(
    where: str, rule: ValueRule, t: torch.Tensor, *, note: str = "", original: torch.Tensor | None = None
) -> None:
    """Refuse ``t`` if any of its values breaks ``rule``. Every rule marks the values outside an
    interval (and NaN, which ``aminmax`` propagates), so one ``aminmax`` pass over the tensor decides;
    only the failure path runs the rule elementwise to find the first bad value. ``original``: the
    tensor to quote values from when ``t`` is a converted copy (``note`` says how)."""
    if not t.numel() or not bool(rule.bad(torch.stack(torch.aminmax(t)), torch).any()):
        return
    flat = rule.bad(t, torch).flatten()
    first = int(flat.nonzero()[0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(first), tuple(t.shape))]
    quoted = t if original is None else original
    value = quoted.flatten()[first].item()
    shown = f"0x{int(value):02X}" if quoted.dtype == torch.uint8 else repr(value)
    raise ValueError(
        f"{where}: {int(flat.sum())} of {t.numel()} values break the rule '{rule.name}' ({rule.expected}); "
        f"the first is {shown} at index {index}{note}. Likely cause: {rule.cause}. Export the checkpoint "
        "again from valid weights (vllm-omni-mxfp4 merge checks every tensor's values)."
    )


def as_packed(t: torch.Tensor, k_full: int, where: str) -> torch.Tensor:
    """A checkpoint weight as packed E2M1 bytes: uint8 (N, K/2) as is, numeric FP4 (N, K) packed."""
    if t.dtype == torch.uint8:
        if t.dim() != 2 or t.shape[-1] != k_full // 2:
            raise ValueError(
                f"{where}: packed FP4 weight must be uint8 (N, {k_full // 2}), got {tuple(t.shape)}"
            )
        return t
    if t.dtype not in _FLOATS or t.dim() != 2 or t.shape[-1] != k_full:
        raise ValueError(
            f"{where}: expected packed uint8 (N, {k_full // 2}) or numeric FP4 values (N, {k_full}) in a float "
            f"dtype, got {t.dtype} {tuple(t.shape)}"
        )
    values = t.float()
    codes = e2m1_encode(values)
    off_grid = e2m1_decode(codes) != values
    if bool(off_grid.any()):
        first = values[off_grid][0].item()
        mxfp8 = (
            "; a float8_e4m3fn weight off that grid is an MXFP8 W8A8 layer's: the quantization_config lists such "
            "layers in mxfp8_layers (vllm-omni-mxfp4 merge writes it; omit the quantization argument so that "
            "the checkpoint's config.json is used)"
            if t.dtype == torch.float8_e4m3fn
            else ""
        )
        raise ValueError(
            f"{where}: numeric weight holds values that are not FP4 E2M1 numbers ({int(off_grid.sum())} of "
            f"{values.numel()}, e.g. {first}); an offline checkpoint stores E2M1 values (or packed bytes) and "
            f"the E8M0 scales separately{mxfp8}"
        )
    return pack_fp4(codes)


def materialize(layer: torch.nn.Module, name: str, device: torch.device) -> Parameter:
    """Replace the meta-device parameter ``name`` (an online weight) by real memory on ``device``."""
    meta = getattr(layer, name)
    real = Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=device), requires_grad=False)
    for key, value in vars(meta).items():
        if not key.startswith("_"):
            setattr(real, key, value)
    layer.register_parameter(name, real)
    return real


def counted_load(
    state: MxLayerState, layer: torch.nn.Module, name: str, load: Callable[[torch.Tensor], Any]
) -> int:
    """Run ``load(target)`` on parameter ``name``, count the elements it wrote; the new total."""
    target = getattr(layer, name)
    if target.is_meta:
        target = materialize(layer, name, state.load_device)
    counter = CopyCounter(target)
    with counter:
        load(target)
    state.loaded[name] = state.loaded_count(name) + counter.count
    if state.phase is Phase.CREATED:
        state.phase = Phase.LOADING
    return state.loaded[name]
