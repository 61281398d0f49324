"""NVFP4 numerics: the canonical NVFP4 weight and its exact float32 dequantization.

NVFP4 (the source format of requantization, docs/nvfp4.md) stores a Linear weight ``(N, K)`` as

- ``codes``: uint8 ``(N, K/2)``, two E2M1 codes a byte, the even element in the low nibble (the
  layout :func:`~.e2m1.pack_fp4` writes; producers that differ are normalised by
  :mod:`vllm_omni_mxfp4.sources.nvfp4` before they get here);
- ``scales``: FP8 E4M3 ``(N, K/16)``, one per 16 consecutive elements of a row, row-major;
- ``global_scale``: float32, one for the tensor (0-dim) or one per output row ``(N,)`` (fused Q/K/V
  whose parts were calibrated apart); a multiplier (ModelOpt ``weight_scale_2``, Comfy) or, with
  ``global_divides``, a divisor (compressed-tensors ``weight_global_scale``).

An element's value is ``q * s * g`` (or ``q * s / G``). ``q * s`` is exact in float32 (E2M1 has two
significant bits, E4M3 four), so two roundings orders are possible, and :func:`dequantize_nvfp4`
offers both:

- ``order="exact"`` (default): ``fl((q * s) * g)``, the product rounded once: the value a tensor
  core computes when it applies ``g`` to the exact block product. Requantization starts from it.
- ``order="scale_first"``: ``fl(q * fl(s * g))``, what ModelOpt (``NVFP4QTensor.dequantize``),
  comfy-kitchen (``dequantize_nvfp4``), compressed-tensors (``s / G`` first) and SGLang's torch
  path compute; bit for bit their float32 dequantization.

:func:`quantize_nvfp4` and :func:`fake_quantize_nvfp4` make NVFP4 the way ModelOpt does (per-tensor
``g = amax / (6 * 448)``, E4M3 block scales, RNE E2M1 codes): what the quality comparison of native
NVFP4 against requantized MXFP4 emulates (docs/nvfp4.md, "Quality").

The two differ by at most one float32 ulp, and only where ``|q|`` is 1.5, 3 or 6 and ``s * g`` is not
exact; they agree whenever ``g`` is a power of two. Code 8 decodes to -0.0 here (E2M1's sign bit);
some producers decode it to +0.0, which compares equal.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vllm_omni_mxfp4 import spec

from .e2m1 import e2m1_decode, e2m1_encode, pack_fp4, unpack_fp4

NVFP4_BLOCK = spec.NVFP4_BLOCK
DEQUANT_ORDERS = ("exact", "scale_first")
"""The rounding orders of :func:`dequantize_nvfp4`."""

CHUNK_ELEMENTS = 1 << 18
"""Elements per row chunk: the float32 temporaries of one chunk stay in cache and the peak extra
memory of a whole-layer pass stays a small fraction of one layer in float32."""


@dataclass(frozen=True)
class Nvfp4Weight:
    """One Linear's NVFP4 weight in the canonical layout (see the module docstring).

    ``name`` (the checkpoint layer) only labels error messages. Construction checks dtypes and
    shapes, so every consumer can rely on them.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    global_divides: bool = False
    name: str = "weight"

    def __post_init__(self) -> None:
        _check_dtypes(self)
        _check_shapes(self)

    @property
    def shape(self) -> tuple[int, int]:
        """The logical ``(N, K)`` of the weight."""
        return self.codes.shape[0], self.codes.shape[1] * 2

    def row_global(self, rows: slice) -> torch.Tensor:
        """float32 global scale of ``rows`` broadcastable against ``(rows, groups, 16)`` blocks."""
        g = self.global_scale
        return g.reshape(1, 1, 1) if g.dim() == 0 else g[rows].reshape(-1, 1, 1)


def _check_dtypes(w: Nvfp4Weight) -> None:
    """Reject tensors whose dtype is not the canonical one, naming the layer and the fix."""
    if w.codes.dtype != torch.uint8:
        raise TypeError(f"{w.name}: NVFP4 codes must be packed uint8, got {w.codes.dtype}")
    if w.scales.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(
            f"{w.name}: NVFP4 block scales must be float8_e4m3fn (or its uint8 bytes), got {w.scales.dtype}"
        )
    if w.global_scale.dtype != torch.float32:
        raise TypeError(f"{w.name}: the NVFP4 global scale must be float32, got {w.global_scale.dtype}")
    bad = ~torch.isfinite(w.global_scale) | (w.global_scale <= 0)
    if bool(bad.any()):
        raise ValueError(
            f"{w.name}: the NVFP4 global scale must be finite and > 0, got {w.global_scale.flatten()[:4].tolist()}"
            "; the checkpoint is corrupt or its calibration diverged"
        )


def _check_shapes(w: Nvfp4Weight) -> None:
    """Codes ``(N, K/2)``, scales ``(N, K/16)``, global scale ``()`` or ``(N,)``; else a ValueError."""
    if w.codes.dim() != 2 or w.scales.dim() != 2:
        raise ValueError(
            f"{w.name}: NVFP4 codes and scales must be 2-D, got {tuple(w.codes.shape)} and {tuple(w.scales.shape)}"
        )
    n, k = w.shape
    if k % NVFP4_BLOCK:
        raise ValueError(f"{w.name}: NVFP4 K={k} is not a multiple of the group size {NVFP4_BLOCK}")
    want = (n, k // NVFP4_BLOCK)
    if tuple(w.scales.shape) != want:
        raise ValueError(
            f"{w.name}: NVFP4 block scales have shape {tuple(w.scales.shape)}, expected {want} for codes "
            f"{tuple(w.codes.shape)} (one E4M3 scale per {NVFP4_BLOCK} elements, row-major)"
        )
    if tuple(w.global_scale.shape) not in ((), (n,)):
        raise ValueError(
            f"{w.name}: the NVFP4 global scale has shape {tuple(w.global_scale.shape)}, expected () or ({n},)"
        )


def e4m3_to_float(scales: torch.Tensor) -> torch.Tensor:
    """float32 values of FP8 E4M3 scales (``float8_e4m3fn`` or its uint8 bytes); 0x7F / 0xFF are NaN.

    Every E4M3 value is exact in float32, so this is a lossless widening.
    """
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e4m3fn)
    return scales.to(torch.float32)


@functools.cache
def _byte_values(device: torch.device) -> torch.Tensor:
    """(256, 2) float32: the two E2M1 values of each byte, even (low-nibble) element first."""
    pairs = unpack_fp4(torch.arange(256, dtype=torch.uint8).reshape(256, 1))
    return e2m1_decode(pairs).to(device)


def row_slices(rows: int, k: int, elements: int = CHUNK_ELEMENTS) -> Iterator[slice]:
    """Consecutive row ranges of about ``elements`` elements each (at least one row)."""
    step = max(1, elements // max(k, 1))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def dequantize_rows(w: Nvfp4Weight, rows: slice, order: str = "exact") -> torch.Tensor:
    """float32 values ``(len(rows), K)`` of the rows ``rows`` of ``w`` (see :func:`dequantize_nvfp4`)."""
    codes = w.codes[rows]
    r, k = codes.shape[0], w.shape[1]
    q = _byte_values(codes.device)[codes.long()].reshape(r, k // NVFP4_BLOCK, NVFP4_BLOCK)
    s = e4m3_to_float(w.scales[rows]).unsqueeze(-1)
    g = w.row_global(rows)
    if order == "exact":
        qs = q.mul_(s)  # exact: at most 6 significant bits
        out = qs.div_(g) if w.global_divides else qs.mul_(g)
    elif order == "scale_first":
        out = q.mul_(s / g if w.global_divides else s * g)
    else:
        raise ValueError(f"order must be one of {list(DEQUANT_ORDERS)}, got {order!r}")
    return out.reshape(r, k)


def dequantize_nvfp4(w: Nvfp4Weight, *, order: str = "exact") -> torch.Tensor:
    """float32 ``(N, K)`` values of an NVFP4 weight, rounded in ``order`` (module docstring).

    Processes rows in chunks so the only full-size allocation is the result.
    """
    if order not in DEQUANT_ORDERS:
        raise ValueError(f"order must be one of {list(DEQUANT_ORDERS)}, got {order!r}")
    n, k = w.shape
    out = torch.empty((n, k), dtype=torch.float32, device=w.codes.device)
    for rows in row_slices(n, k):
        out[rows] = dequantize_rows(w, rows, order)
    return out


E4M3_MIN = 2.0**-9
"""The smallest positive E4M3 value (a subnormal): block scales are clamped to it so that no
nonzero block gets a zero scale."""


def quantize_nvfp4(x: torch.Tensor, name: str = "weight") -> Nvfp4Weight:
    """NVFP4 of a ``(N, K)`` tensor the way ModelOpt quantizes a weight (``NVFP4QTensor``):
    ``g = amax / (6 * 448)`` per tensor, each 16-block's scale ``amax_block / (6 * g)`` rounded to
    E4M3 (clamped to [2^-9, 448]), codes RNE E2M1 of ``x / (s * g)``. An all-zero tensor gets g = 1.
    """
    n, k = x.shape
    if k % NVFP4_BLOCK:
        raise ValueError(f"{name}: K={k} is not a multiple of the NVFP4 group size {NVFP4_BLOCK}")
    blocks = x.float().reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = blocks.abs().amax()
    g = amax / (spec.E2M1_MAX * spec.E4M3_MAX) if bool(amax > 0) else torch.ones((), dtype=torch.float32)
    s = (blocks.abs().amax(-1) / (spec.E2M1_MAX * g)).clamp(E4M3_MIN, spec.E4M3_MAX).to(torch.float8_e4m3fn)
    codes = e2m1_encode(blocks / (s.float() * g).unsqueeze(-1)).reshape(n, k)
    return Nvfp4Weight(pack_fp4(codes), s, g.reshape(()).float(), name=name)


def fake_quantize_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """NVFP4 quantize-dequantize of activations along the last dimension, in ``x``'s dtype.

    The global scale is dynamic (this tensor's amax), where a deployed NVFP4 model uses a calibrated
    ``input_scale``: the emulation is the format's best case for activations.
    """
    flat = x.reshape(-1, x.shape[-1])
    w = quantize_nvfp4(flat, name="activation")
    return dequantize_nvfp4(w, order="scale_first").to(x.dtype).reshape(x.shape)
