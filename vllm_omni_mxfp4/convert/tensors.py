"""Output tensors of the convert that are computed with torch, written through the checkpoint writer.

Each class here is a :class:`~vllm_omni_mxfp4.safetensors_io.TensorSource`: it knows its
size up front (so headers and shards are planned before any numerics run) and produces its bytes
only when the writer reaches it. A layer's work is done once and kept in a one-layer cache
(:class:`LayerCache`), because its ``weight`` and ``weight_scale`` are written one after the other;
memory stays at one layer's results plus row-chunk temporaries, whatever the model size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

import torch

from vllm_omni_mxfp4.formats.nvfp4 import Nvfp4Weight, dequantize_rows, row_slices
from vllm_omni_mxfp4.formats.requant import Requantized, requantize_nvfp4
from vllm_omni_mxfp4.formats.scale_rules import e8m0_to_float
from vllm_omni_mxfp4.sources.nvfp4.names import Renamed

Progress = Callable[[int], None]


def rows_of(t: torch.Tensor, part: Renamed) -> torch.Tensor:
    """The rows of ``t`` (any tensor indexed by output row first) that ``part`` takes."""
    if part.swap_halves:
        if t.shape[0] % 2:
            raise ValueError(f"{part.name}: cannot swap the halves of {t.shape[0]} rows")
        return torch.cat(t.chunk(2, dim=0)[::-1])
    if part.parts == 1:
        return t
    if t.shape[0] % part.parts:
        raise ValueError(f"{part.name}: {t.shape[0]} rows do not split into {part.parts} equal parts")
    return t.chunk(part.parts, dim=0)[part.part]


def write_tensor(out: BinaryIO, t: torch.Tensor, progress: Progress) -> None:
    """Write a CPU tensor's bytes (native little-endian layout, as safetensors stores them)."""
    data = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")
    size = data.nbytes
    while data:  # an unbuffered file may write less than asked
        data = data[out.write(data) :]
    progress(size)


class LayerCache:
    """The last layer's computed result, by key: a layer is computed once for its several tensors."""

    def __init__(self) -> None:
        self._key: object = None
        self._value: object = None

    def get(self, key: object, compute: Callable[[], object]) -> object:
        """The cached value of ``key``, or ``compute()`` (replacing whatever was cached)."""
        if self._key != key:
            self._key, self._value = None, None  # free the previous layer first
            self._value = compute()
            self._key = key
        return self._value


@dataclass
class RequantLayer:
    """One NVFP4 Linear to requantize: how to load it, the rule, and where its error report goes."""

    name: str
    load: Callable[[], Nvfp4Weight]
    rule: str
    cache: LayerCache
    errors: dict[str, object]

    def result(self) -> Requantized:
        """The layer's MXFP4 result (computed once; its error is recorded under the layer's name)."""
        return self.cache.get(("requant", self.name, self.rule), self._compute)

    def _compute(self) -> Requantized:
        result = requantize_nvfp4(self.load(), self.rule)
        self.errors[self.name] = result.error
        return result


@dataclass(frozen=True)
class RequantTensor:
    """``data`` (``weight``) or ``scale`` (``weight_scale``) of a requantized layer, rows of ``part``."""

    layer: RequantLayer
    which: str
    part: Renamed
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape)

    def write_to(self, out: BinaryIO, progress: Progress) -> None:
        write_tensor(out, rows_of(getattr(self.layer.result(), self.which), self.part), progress)


@dataclass(frozen=True)
class Nvfp4ToBf16:
    """An NVFP4 weight's exact float32 dequant rounded to BF16, written in row chunks (a layer the
    target runs in BF16). Each element is rounded once, from the exact ``q * s * g``."""

    load: Callable[[], Nvfp4Weight]
    part: Renamed
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 2

    def write_to(self, out: BinaryIO, progress: Progress) -> None:
        w = self.load()
        n, k = w.shape
        if self.part.parts == 1 and not self.part.swap_halves:
            for rows in row_slices(n, k):
                write_tensor(out, dequantize_rows(w, rows).to(torch.bfloat16), progress)
            return
        full = torch.cat([dequantize_rows(w, rows).to(torch.bfloat16) for rows in row_slices(n, k)])
        write_tensor(out, rows_of(full, self.part), progress)


@dataclass(frozen=True)
class Fp8ToBf16:
    """An FP8 E4M3 weight times its scale, rounded once to BF16 (8 significant bits, FP8 has 4).

    Scales: float32 per tensor ``()`` / ``(1,)``, per row ``(N,)`` / ``(N, 1)``, or uint8 E8M0 per 32
    inputs ``(N, K/32)`` (Comfy ``mxfp8``).
    """

    name: str
    weight: Callable[[], torch.Tensor]
    scale: Callable[[], torch.Tensor]
    part: Renamed
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 2

    def write_to(self, out: BinaryIO, progress: Progress) -> None:
        w, s = self.weight().to(torch.float32), self.scale()
        n, k = w.shape
        if s.dtype == torch.uint8 and s.dim() == 2 and k % 32 == 0 and tuple(s.shape) == (n, k // 32):
            values = (w.reshape(n, -1, 32) * e8m0_to_float(s).unsqueeze(-1)).reshape(n, k)
        elif s.dtype == torch.float32 and s.numel() in (1, n):
            values = w * (s.reshape(()) if s.numel() == 1 else s.reshape(n, 1))
        else:
            raise ValueError(
                f"{self.name}: FP8 weight_scale {s.dtype} {tuple(s.shape)} for weight {(n, k)} is neither "
                f"per tensor, per row nor E8M0 per 32; re-export the checkpoint"
            )
        write_tensor(out, rows_of(values.to(torch.bfloat16), self.part), progress)


@dataclass(frozen=True)
class RowsOf:
    """A stored tensor (any dtype) written as the rows ``part`` takes (a split or swapped BFL tensor)."""

    get: Callable[[], torch.Tensor]
    part: Renamed
    nbytes: int

    def write_to(self, out: BinaryIO, progress: Progress) -> None:
        write_tensor(out, rows_of(self.get(), self.part), progress)


@dataclass(frozen=True)
class Float32Of:
    """A small floating tensor (``pre_quant_scale``) written as float32, the Smooth ``mul_scale``."""

    get: Callable[[], torch.Tensor]
    nbytes: int

    def write_to(self, out: BinaryIO, progress: Progress) -> None:
        write_tensor(out, self.get().to(torch.float32), progress)
