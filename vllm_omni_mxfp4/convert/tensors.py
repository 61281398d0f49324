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

from vllm_omni_mxfp4.errors import CheckpointError
from vllm_omni_mxfp4.formats.nvfp4 import Nvfp4Weight
from vllm_omni_mxfp4.formats.requant import Requantized
from vllm_omni_mxfp4.kernels.requant import requantize_nvfp4
from vllm_omni_mxfp4.sources.nvfp4 import LayerSource, SourceError
from vllm_omni_mxfp4.sources.nvfp4.dequant import dequantized_chunks
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
    workers: int = 1

    def result(self) -> Requantized:
        """The layer's MXFP4 result (computed once; its error is recorded under the layer's name)."""
        return self.cache.get(("requant", self.name, self.rule), self._compute)

    def _compute(self) -> Requantized:
        result = requantize_nvfp4(self.load(), self.rule, workers=self.workers)
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
class DequantizedToBf16:
    """A layer's exact dequant (:func:`~vllm_omni_mxfp4.sources.nvfp4.dequant.dequantized_chunks`:
    NVFP4 with its ``pre_quant_scale`` folded in, or FP8 times its scale in any of its forms),
    rounded once to BF16 and written in row chunks: a layer the target runs in BF16."""

    layer: LayerSource
    get: Callable[[str], torch.Tensor]
    part: Renamed
    shape: tuple[int, int]
    where: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 2

    def write_to(self, out: BinaryIO, progress: Progress) -> None:
        try:
            self._write(out, progress)
        except SourceError as exc:
            raise CheckpointError(f"{self.where}: {exc}") from None

    def _write(self, out: BinaryIO, progress: Progress) -> None:
        _, chunks = dequantized_chunks(self.layer, self.get)
        if self.part.parts == 1 and not self.part.swap_halves:
            for _, values in chunks:
                write_tensor(out, values.to(torch.bfloat16), progress)
            return
        full = torch.cat([values.to(torch.bfloat16) for _, values in chunks])
        write_tensor(out, rows_of(full, self.part), progress)


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
