"""Producer layouts -> the canonical :class:`~vllm_omni_mxfp4.formats.nvfp4.Nvfp4Weight`, in one place.

Every difference between NVFP4 producers that the numerics must not see is undone here:

- nibble order: ModelOpt and compressed-tensors put the even element in the low nibble (canonical),
  Comfy / comfy-kitchen in the high one; SGLang's ``swap_weight_nibbles`` declares the same swap.
  :func:`swap_nibbles` converts (it is its own inverse);
- scale layout: row-major ``(N, K/16)``, or the cuBLAS 2-D blocked layout (128 rows x 4 scale
  columns per tile, zero-padded; ModelOpt's ``enable_swizzle_layout``, comfy-kitchen).
  :func:`unswizzle_scales` restores row-major order and drops the padding;
- global scale: a multiplier (``weight_scale_2``) or a divisor (compressed-tensors
  ``weight_global_scale``, kept as a divisor so the dequant rounds as the producer's does);
- fused Q/K/V: separately stored parts joined along N with one global scale per row when their
  scales differ (:func:`fuse_rows`);
- ``pre_quant_scale`` (AWQ input multiplier): checked and returned as the Smooth ``mul_scale``
  (:func:`load_mul_scale`), since ``x * s`` before the GEMM is what both mean;
- comfy-kitchen's zero padding of N to a multiple of 16: stripped back to the model's N, refused if
  the padded rows are not zeros (:func:`strip_padding`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vllm_omni_mxfp4 import spec
from vllm_omni_mxfp4.formats.nvfp4 import Nvfp4Weight

from .records import LayerSource, SourceError

TensorGetter = Callable[[str], torch.Tensor]
"""Returns a checkpoint tensor by key (a safetensors ``get_tensor``, a dict's ``__getitem__``)."""


def swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Packed uint8 FP4 with its two nibbles exchanged (high-even <-> low-even)."""
    return (packed >> 4) | (packed << 4)


def unswizzle_scales(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Row-major ``(rows, cols)`` scales from the cuBLAS 2-D blocked layout.

    The blocked tensor holds ``(ceil(rows/128), ceil(cols/4))`` tiles in row-major tile order; a
    tile stores its 128 x 4 scales as ``[r % 32][r // 32][c]`` (32 x 16 bytes), so that one
    32-row slab of four row groups is contiguous for the tensor cores.
    """
    tile_rows, tile_cols = spec.NVFP4_SCALE_TILE
    row_tiles, col_tiles = spec.ceil_div(rows, tile_rows), spec.ceil_div(cols, tile_cols)
    if blocked.numel() != row_tiles * tile_rows * col_tiles * tile_cols:
        raise ValueError(
            f"unswizzle_scales: {tuple(blocked.shape)} is not the blocked layout of a ({rows}, {cols}) scale "
            f"matrix ({row_tiles * tile_rows} x {col_tiles * tile_cols} elements expected)"
        )
    slabs = tile_rows // 4
    tiles = blocked.reshape(row_tiles, col_tiles, slabs, 4, tile_cols).transpose(2, 3)
    full = tiles.reshape(row_tiles, col_tiles, tile_rows, tile_cols).permute(0, 2, 1, 3)
    return full.reshape(row_tiles * tile_rows, col_tiles * tile_cols)[:rows, :cols].contiguous()


def strip_padding(w: Nvfp4Weight, n: int, k: int) -> Nvfp4Weight:
    """``w`` cut back to the model's ``(n, k)`` from comfy-kitchen's 16-row padding.

    comfy-kitchen (``TensorCoreNVFP4Layout.get_padded_shape``) pads a weight with zeros to
    ``(roundup(N, 16), roundup(K, 16))`` before quantizing, and stores the padded codes and scales.
    The padded rows are dropped here after checking that they hold zeros (codes and block scales),
    as the padding does; anything else is refused: the stored rows would not be the model's. A
    padded K (not a multiple of 16) cannot be cut inside an NVFP4 block and is refused.
    """
    stored_n, stored_k = w.shape
    if (stored_n, stored_k) == (n, k):
        return w
    if k % spec.NVFP4_BLOCK or stored_k != k or stored_n != spec.round_up(n, spec.NVFP4_BLOCK):
        raise SourceError(
            w.name,
            f"stored shape {(stored_n, stored_k)} is not the model's {(n, k)} padded to multiples of "
            f"{spec.NVFP4_BLOCK} rows",
            "only row padding of K-aligned weights can be stripped; check the model or re-export it",
        )
    pad_codes, pad_scales = w.codes[n:], w.scales.view(torch.uint8)[n:]
    if bool(pad_codes.any()) or bool(pad_scales.any()):
        raise SourceError(
            w.name,
            f"padded rows {n}..{stored_n - 1} hold non-zero codes or block scales (the padding is zeros)",
            "the stored rows are not the model's; check the model or re-export it",
        )
    scales = w.scales[:n].contiguous()
    g = w.global_scale if w.global_scale.dim() == 0 else w.global_scale[:n].contiguous()
    return Nvfp4Weight(w.codes[:n].contiguous(), scales, g, w.global_divides, w.name)


def load_nvfp4_weight(
    layer: LayerSource, get: TensorGetter, shape: tuple[int, int] | None = None
) -> Nvfp4Weight:
    """The canonical NVFP4 weight of a ``requantize`` layer described by :mod:`.detect`.

    With ``shape``, the model's ``(N, K)`` of the layer: comfy-kitchen's zero row padding beyond it is
    stripped (:func:`strip_padding`)."""
    if layer.action != "requantize" or layer.shape is None:
        raise ValueError(f"{layer.name}: action {layer.action!r} has no NVFP4 weight to load")
    n, k = layer.shape
    codes = get(layer.tensors["weight"])
    if layer.nibble_order == "high_even":
        codes = swap_nibbles(codes)
    scales = get(layer.tensors["weight_scale"])
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e4m3fn)
    if layer.scale_layout == "swizzled":
        scales = unswizzle_scales(scales, n, k // spec.NVFP4_BLOCK)
    g = get(layer.tensors["global_scale"]).to(torch.float32).reshape(())
    try:
        w = Nvfp4Weight(codes.contiguous(), scales.contiguous(), g, layer.global_divides, layer.name)
    except (TypeError, ValueError) as exc:
        raise SourceError(
            layer.name, str(exc), "the tensors do not match the header; the file is corrupt"
        ) from None
    return w if shape is None else strip_padding(w, *shape)


def load_mul_scale(layer: LayerSource, get: TensorGetter) -> torch.Tensor | None:
    """The layer's ``pre_quant_scale`` as a float32 Smooth multiplier ``(K,)``, or None if it has none.

    Refuses values that are not finite and > 0: the Smooth multiplier divides nothing back out, so
    such a scale cannot be folded (docs/nvfp4.md).
    """
    key = layer.tensors.get("mul_scale")
    if key is None:
        return None
    scale = get(key).to(torch.float32)
    bad = ~torch.isfinite(scale) | (scale <= 0)
    if bool(bad.any()):
        raise SourceError(
            layer.name,
            f"pre_quant_scale has {int(bad.sum())} values that are not finite and > 0; it cannot be folded",
            "serve this layer unquantized (add it to ignored_layers)",
        )
    return scale


def fuse_rows(parts: Sequence[Nvfp4Weight], name: str) -> Nvfp4Weight:
    """Join NVFP4 weights along N (fused Q/K/V, gate/up) into one canonical weight.

    Equal global scales stay one scalar; different ones become one per output row, which is how a
    producer that calibrated the parts apart is served exactly.
    """
    if not parts:
        raise ValueError(f"{name}: no parts to fuse")
    ks = {p.shape[1] for p in parts}
    divides = {p.global_divides for p in parts}
    if len(ks) != 1 or len(divides) != 1:
        raise SourceError(
            name,
            f"cannot fuse parts with K {sorted(ks)} and global-scale kinds {sorted(divides)}",
            "check the names",
        )
    codes = torch.cat([p.codes for p in parts])
    scales = torch.cat([p.scales.view(torch.uint8) for p in parts]).view(parts[0].scales.dtype)
    globals_ = [p.global_scale.reshape(-1).expand(p.shape[0]) for p in parts]
    g = torch.cat(globals_)
    if bool((g == g[0]).all()):
        g = g[0].clone()
    return Nvfp4Weight(codes, scales, g, parts[0].global_divides, name)
