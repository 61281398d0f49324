"""The one dequantization of an NVFP4 checkpoint's layers to floating point, for the layers that run
unquantized: FP8 layers of a mixed checkpoint (``dequantize``) and NVFP4 layers whose Linear runs in
BF16 (``requantize`` layers the target does not quantize).

Every value is computed exactly in float32 and rounded once to the output dtype:

- NVFP4: ``q * s * g`` (:func:`~vllm_omni_mxfp4.formats.nvfp4.dequantize_rows`), with the producer's
  ``pre_quant_scale`` folded into the columns (the Linear computes ``W (x * m)``: its weight is
  ``W * m`` per input channel);
- FP8 E4M3 times its ``weight_scale``, which producers store in one of three forms: float32 per
  tensor (``()`` or ``(1,)``), float32 per output row (``(N,)`` or ``(N, 1)``), or uint8 E8M0 codes
  per 32 inputs (``(N, K/32)``, Comfy ``mxfp8``; ``float8_e8m0fnu`` is read as its codes). Any other
  scale is refused, naming the layer.

Both the engine (load-time requantization) and ``convert`` call :func:`dequantized_chunks`; there is
no second copy of these rules.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ... import spec
from ...formats.nvfp4 import dequantize_rows, row_slices
from ...formats.scale_rules import e8m0_to_float
from .layouts import TensorGetter, load_mul_scale, load_nvfp4_weight
from .records import LayerSource, SourceError


def fp8_scale_form(name: str, scale: torch.Tensor, n: int, k: int) -> str:
    """``tensor``, ``row`` or ``e8m0``: the form of an FP8 layer's ``weight_scale`` for an ``(n, k)``
    weight; :class:`SourceError` naming the layer for anything else."""
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        scale = scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        if scale.dim() == 2 and k % spec.MX_BLOCK == 0 and tuple(scale.shape) == (n, k // spec.MX_BLOCK):
            return "e8m0"
    elif scale.is_floating_point():
        if scale.numel() == 1 and scale.dim() <= 1:
            return "tensor"
        if tuple(scale.shape) in ((n,), (n, 1)):
            return "row"
    raise SourceError(
        name,
        f"FP8 weight_scale {scale.dtype} {tuple(scale.shape)} for a weight of {(n, k)} is neither per tensor, "
        f"per row (N,) / (N, 1) nor E8M0 per {spec.MX_BLOCK} inputs (N, K/{spec.MX_BLOCK})",
        "re-export the checkpoint",
    )


def _fp8_chunks(
    layer: LayerSource, get: TensorGetter
) -> tuple[tuple[int, int], Iterator[tuple[slice, torch.Tensor]]]:
    weight = get(layer.tensors["weight"])
    scale = get(layer.tensors["weight_scale"])
    n, k = weight.shape
    form = fp8_scale_form(layer.name, scale, n, k)
    if form == "e8m0":
        factors = e8m0_to_float(scale if scale.dtype == torch.uint8 else scale.view(torch.uint8))
    else:
        factors = scale.to(torch.float32).reshape(() if form == "tensor" else (n, 1))

    def chunks() -> Iterator[tuple[slice, torch.Tensor]]:
        for rows in row_slices(n, k):
            values = weight[rows].to(torch.float32)
            if form == "e8m0":
                blocks = values.reshape(values.shape[0], -1, spec.MX_BLOCK) * factors[rows].unsqueeze(-1)
                values = blocks.reshape(values.shape)
            else:
                values = values * (factors[rows] if form == "row" else factors)
            yield rows, values

    return (n, k), chunks()


def dequantized_chunks(
    layer: LayerSource, get: TensorGetter
) -> tuple[tuple[int, int], Iterator[tuple[slice, torch.Tensor]]]:
    """The ``(N, K)`` of a layer's weight and its exact dequantized values as ``(rows, float32)``
    row chunks (memory: one chunk's float32 values, never a whole layer)."""
    if layer.action == "dequantize":
        return _fp8_chunks(layer, get)
    w = load_nvfp4_weight(layer, get)
    smooth = load_mul_scale(layer, get)

    def chunks() -> Iterator[tuple[slice, torch.Tensor]]:
        for rows in row_slices(*w.shape):
            values = dequantize_rows(w, rows)
            yield rows, values if smooth is None else values * smooth

    return tuple(w.shape), chunks()


def dequantize_layer(
    layer: LayerSource, get: TensorGetter, dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """A layer's whole weight in ``dtype`` (on ``device``, default the device of its tensors), from
    :func:`dequantized_chunks`: each value rounded once."""
    shape, chunks = dequantized_chunks(layer, get)
    out = None
    for rows, values in chunks:
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=device or values.device)
        out[rows] = values.to(dtype)
    return out if out is not None else torch.empty(shape, dtype=dtype, device=device)
