"""Streaming safetensors: header-only readers, sharded archives and a writer that copies tensor bytes.

The merge never loads a model: it reads safetensors headers (a few KB), reads small tensors (scales)
one at a time to validate them, and streams every tensor's bytes from its source file to its output
file in bounded chunks (``os.copy_file_range`` where the kernel offers it). Memory therefore stays at
one chunk plus the headers, whatever the model size.

Format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON
header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` and the
concatenated tensor data; offsets are relative to the end of the header and must tile the data
without gaps.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import numpy as np

from vllm_omni_mxfp4 import spec

from .errors import CheckpointError, require_regular_file

#: Bytes per element of each safetensors dtype.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

_MAX_HEADER = 100 * 1024 * 1024
COPY_CHUNK = 16 * 1024 * 1024
CODE_DTYPES = frozenset({"U8", "F8_E4M3", "F8_E5M2", "F8_E8M0"})
"""safetensors dtypes whose values messages show as bytes (E8M0 and FP8 codes, packed FP4 pairs)."""
WEIGHTS_BASENAME = "diffusion_pytorch_model"
"""The file name diffusers gives a model's weights (``.safetensors``, or shards with an ``.index.json``)."""

Progress = Callable[[int], None]


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's name, safetensors dtype and shape: what a safetensors header says about it."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorRef(TensorInfo):
    """Where one tensor's bytes are: file, absolute byte offset and size, plus dtype and shape."""

    path: Path
    offset: int
    nbytes: int

    def read_array(self) -> np.ndarray:
        """The tensor as a numpy array (BF16 as float32, exactly). Meant for small tensors only."""
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            raw = fh.read(self.nbytes)
        if len(raw) != self.nbytes:
            raise CheckpointError(f"{self.path}: tensor {self.name!r} is truncated")
        return decode_array(raw, self.dtype, self.shape)


_NUMPY_DTYPES = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "F8_E4M3": np.uint8,  # its codes: numpy has no FP8 (spec's "e4m3" value rule reads codes)
    "I8": np.int8,
    "I16": np.int16,
    "U16": np.uint16,
    "F16": np.float16,
    "I32": np.int32,
    "U32": np.uint32,
    "F32": np.float32,
    "I64": np.int64,
    "U64": np.uint64,
    "F64": np.float64,
}


def decode_array(raw: bytes, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """Little-endian safetensors bytes as a numpy array; BF16 becomes float32 (exact widening), FP8
    E4M3 its uint8 codes."""
    if dtype == "BF16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    if dtype not in _NUMPY_DTYPES:
        raise CheckpointError(f"cannot decode safetensors dtype {dtype}")
    return np.frombuffer(raw, dtype=np.dtype(_NUMPY_DTYPES[dtype]).newbyteorder("<")).reshape(shape)


def _read_header_json(path: Path) -> tuple[dict, int, int]:
    """The parsed JSON header of a safetensors file, where its data starts, and the file size."""
    require_regular_file(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{path}: not a safetensors file (header length {n} for a {size}-byte file)"
                )
            header = json.loads(fh.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read the safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    return header, 8 + n, size


def _header_entry(path: Path, name: str, info: object, start: int, size: int) -> TensorRef:
    """One tensor's header entry, checked: known dtype, non-negative shape, offsets inside the file."""
    try:
        dtype = info["dtype"]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(v) for v in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}") from None
    if dtype not in DTYPE_SIZES:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
    if any(d < 0 for d in shape) or end - begin != nbytes or begin < 0 or start + end > size:
        raise CheckpointError(f"{path}: tensor {name!r} has inconsistent shape {list(shape)} / offsets")
    return TensorRef(name, dtype, shape, path, start + begin, nbytes)


def read_header(path: Path) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """The tensors and ``__metadata__`` of one safetensors file, checked against the file size.

    The tensors' data must tile the data section: no overlap and no gap.
    """
    header, start, size = _read_header_json(path)
    metadata = header.pop("__metadata__", None) or {}
    tensors = {name: _header_entry(path, name, info, start, size) for name, info in header.items()}
    position = start
    for ref in sorted(tensors.values(), key=lambda r: (r.offset, r.offset + r.nbytes)):
        if ref.offset != position:
            raise CheckpointError(f"{path}: tensor data offsets overlap or leave gaps")
        position = ref.offset + ref.nbytes
    return tensors, metadata


def _check_index_entry(index: Path, name: str, shard: str) -> None:
    """A shard named by an index is a plain file name in the index's directory and a regular file."""
    blame = f"{index}: the index entry for tensor {name!r} names shard {shard!r}"
    if shard in ("", ".", "..") or Path(shard).name != shard or "\\" in shard:
        raise CheckpointError(
            f"{blame}, which is outside {index.parent}; an index may only name files in its own directory"
        )
    require_regular_file(index.parent / shard, f"{blame}:")


def read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of a safetensors index file.

    Every shard must be a file name in the index's own directory and, where it exists, a regular
    file: an entry that leaves the directory or names a FIFO or a device is refused, naming the entry.
    """
    require_regular_file(index)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"{index}: not a safetensors index (expected a JSON object with 'weight_map')"
        ) from None
    checked: set[str] = set()
    for name, shard in weight_map.items():
        if shard not in checked:
            _check_index_entry(index, name, shard)
            checked.add(shard)
    return weight_map


def open_archive(files: Iterable[Path], index: Path | None = None) -> dict[str, TensorRef]:
    """All tensors of a (possibly sharded) checkpoint, by name.

    Rejects a tensor stored in two files, and with an ``index`` (``{"weight_map": {name: file}}``)
    any disagreement between the index and the shards: a listed file or tensor that is missing, or a
    tensor in a shard that the index does not list there.
    """
    files = sorted(files)
    weight_map = None if index is None else read_index(index)
    tensors: dict[str, TensorRef] = {}
    for path in files:
        for name, ref in read_header(path)[0].items():
            if name in tensors:
                raise CheckpointError(
                    f"duplicate tensor {name!r}: stored in both {tensors[name].path} and {path}"
                )
            tensors[name] = ref
    if weight_map is None:
        return tensors
    names = {p.name for p in files}
    for shard in sorted(set(weight_map.values())):
        if shard not in names:
            raise CheckpointError(f"{index}: lists shard {shard!r}, which does not exist")
    for name, shard in weight_map.items():
        if name not in tensors:
            raise CheckpointError(f"{index}: lists tensor {name!r} in {shard}, but no shard holds it")
        if tensors[name].path.name != shard:
            raise CheckpointError(
                f"{index}: lists tensor {name!r} in {shard}, but it is stored in {tensors[name].path.name}"
            )
    for name, ref in tensors.items():
        if name not in weight_map:
            raise CheckpointError(f"{index}: tensor {name!r} in {ref.path.name} is not listed in the index")
    return tensors


def diffusers_archive(directory: Path) -> dict[str, TensorRef]:
    """The tensors of a diffusers model directory (:data:`WEIGHTS_BASENAME`, one file or sharded
    with its index): headers only."""
    index = directory / f"{WEIGHTS_BASENAME}.safetensors.index.json"
    single = directory / f"{WEIGHTS_BASENAME}.safetensors"
    if index.is_file():
        shards = sorted({directory / name for name in read_index(index).values()})
        return open_archive([p for p in shards if p.is_file()], index)
    if single.is_file():
        return open_archive([single])
    raise CheckpointError(
        f"{directory}: no {single.name} or {index.name}; the original transformer must be diffusers safetensors"
    )


def _iter_raw(ref: TensorRef) -> Iterator[bytes]:
    """The bytes of a tensor in chunks of at most ``COPY_CHUNK / 8`` elements."""
    size, elements = DTYPE_SIZES[ref.dtype], max(1, COPY_CHUNK // 8)
    with open(ref.path, "rb") as fh:
        fh.seek(ref.offset)
        for start in range(0, ref.nbytes, elements * size):
            want = min(elements * size, ref.nbytes - start)
            raw = fh.read(want)
            if len(raw) != want:
                raise CheckpointError(f"{ref.path}: tensor {ref.name!r} is truncated")
            yield raw


def iter_values(ref: TensorRef) -> Iterator[np.ndarray]:
    """The values of a tensor, flat, in chunks of at most ``COPY_CHUNK / 8`` elements (BF16 as
    float32): any tensor in bounded memory."""
    size = DTYPE_SIZES[ref.dtype]
    for raw in _iter_raw(ref):
        yield decode_array(raw, ref.dtype, (len(raw) // size,))


# A float is NaN or infinite exactly when its exponent bits are all ones.
_EXPONENT_BITS = {"BF16": ("<u2", 0x7F80), "F16": ("<u2", 0x7C00), "F32": ("<u4", 0x7F800000)}


def first_nonfinite(ref: TensorRef) -> tuple[list[int], float] | None:
    """The index and value of the first NaN or infinity of a float tensor, or ``None``.

    Read from the exponent bits of the stored bytes (no widening to float32), so that checking every
    unquantized tensor of a checkpoint costs little more than reading it.
    """
    if ref.dtype not in _EXPONENT_BITS:
        return first_bad_value(ref, lambda values: ~np.isfinite(values))
    bits_dtype, mask = _EXPONENT_BITS[ref.dtype]
    size, start = DTYPE_SIZES[ref.dtype], 0
    for raw in _iter_raw(ref):
        bits = np.frombuffer(raw, dtype=bits_dtype)
        marked = (bits & mask) == mask
        if marked.any():
            i = int(np.flatnonzero(marked)[0])
            value = float(decode_array(raw[i * size : (i + 1) * size], ref.dtype, (1,))[0])
            return [int(x) for x in np.unravel_index(start + i, ref.shape)], value
        start += bits.size
    return None


def _first_marked(ref: TensorRef, chunks: Iterable[tuple[np.ndarray, tuple]]) -> tuple | None:
    """``(index in ref's shape, payload values there)`` of the first element a chunk's mask marks."""
    start = 0
    for marked, payload in chunks:
        if not marked.any():
            start += marked.size
            continue
        found = np.flatnonzero(marked)
        if found.size:
            at = np.unravel_index(start + int(found[0]), ref.shape)
            return [int(i) for i in at], *(float(values[found[0]]) for values in payload)
        start += marked.size
    return None


def first_bad_value(
    ref: TensorRef, bad: Callable[[np.ndarray], np.ndarray]
) -> tuple[list[int], float] | None:
    """The index (in the tensor's shape) and the value of the first element ``bad`` marks, or ``None``."""
    return _first_marked(ref, ((bad(v), (v,)) for v in iter_values(ref)))


def first_difference(a: TensorRef, b: TensorRef) -> tuple[list[int], float, float] | None:
    """The first index where two tensors of the same shape hold different numbers (whatever their
    dtypes: numpy compares them exactly; -0.0 equals 0.0) and the two values, or ``None``."""
    return _first_marked(a, ((x != y, (x, y)) for x, y in zip(iter_values(a), iter_values(b))))


class TensorSource(Protocol):
    """Produces exactly ``nbytes`` bytes of one output tensor."""

    nbytes: int

    def write_to(self, out: BinaryIO, progress: Progress) -> None: ...


def _write_all(out: BinaryIO, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = out.write(view)
        view = view[written:]


def copy_range(src: BinaryIO, offset: int, nbytes: int, out: BinaryIO, progress: Progress, what: str) -> None:
    """Copy ``nbytes`` bytes of ``src`` from ``offset`` to ``out``'s position, in bounded chunks.

    Each system call moves at most :data:`COPY_CHUNK` bytes, so a signal reaches the main thread
    within one chunk even for a file of many GB. ``what`` names the input in the truncation error.
    """
    remaining, fast = nbytes, hasattr(os, "copy_file_range")
    while remaining:
        step = min(remaining, COPY_CHUNK)
        done = 0
        if fast:
            try:
                done = os.copy_file_range(src.fileno(), out.fileno(), step, offset)
            except OSError:
                fast = False
        if not done:
            src.seek(offset)
            chunk = src.read(step)
            if len(chunk) != step:
                raise CheckpointError(f"{what} is truncated")
            _write_all(out, chunk)
            done = step
        offset += done
        remaining -= done
        progress(done)


@dataclass(frozen=True)
class CopyBytes:
    """The bytes of an input tensor, unchanged."""

    ref: TensorRef

    @property
    def nbytes(self) -> int:
        return self.ref.nbytes

    def write_to(self, out: BinaryIO, progress: Progress) -> None:
        with open(self.ref.path, "rb", buffering=0) as src:
            copy_range(
                src,
                self.ref.offset,
                self.ref.nbytes,
                out,
                progress,
                f"{self.ref.path}: tensor {self.ref.name!r}",
            )


@dataclass(frozen=True)
class WidenToF32:
    """A small floating tensor (BF16, F16 or F32) written as F32; the conversion is exact."""

    ref: TensorRef

    @property
    def nbytes(self) -> int:
        return math.prod(self.ref.shape) * 4

    def write_to(self, out: BinaryIO, progress: Progress) -> None:
        data = self.ref.read_array().astype("<f4")
        _write_all(out, data.tobytes())
        progress(self.nbytes)


@dataclass(frozen=True)
class OnesF32:
    """A float32 vector of ones: the identity Smooth of a DualScale layer exported without one."""

    count: int

    @property
    def nbytes(self) -> int:
        return self.count * 4

    def write_to(self, out: BinaryIO, progress: Progress) -> None:
        _write_all(out, np.ones(self.count, dtype="<f4").tobytes())
        progress(self.nbytes)


def _fp4_pair_table() -> np.ndarray:
    """(256, 2) uint16: the BF16 bit patterns of the two E2M1 values of a byte, low nibble first."""
    magnitudes = spec.E2M1_VALUES
    values = np.array(magnitudes + tuple(-m for m in magnitudes), dtype=np.float32)  # code 8 is -0.0
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)
    byte = np.arange(256)
    return np.stack((bf16[byte & 0xF], bf16[byte >> 4]), axis=-1)


_FP4_PAIRS = _fp4_pair_table()


@dataclass(frozen=True)
class UnpackFp4ToBf16:
    """A packed FP4 weight (N, K/2) uint8 written as its numeric values, BF16 (N, K); -0 stays -0."""

    ref: TensorRef

    @property
    def nbytes(self) -> int:
        return self.ref.nbytes * 4

    def write_to(self, out: BinaryIO, progress: Progress) -> None:
        rows, half = self.ref.shape
        rows_per_chunk = max(1, COPY_CHUNK // 4 // max(half, 1))
        with open(self.ref.path, "rb") as src:
            src.seek(self.ref.offset)
            for start in range(0, rows, rows_per_chunk):
                n = min(rows_per_chunk, rows - start)
                packed = np.frombuffer(src.read(n * half), dtype=np.uint8)
                if packed.size != n * half:
                    raise CheckpointError(f"{self.ref.path}: tensor {self.ref.name!r} is truncated")
                _write_all(out, _FP4_PAIRS[packed].astype("<u2").tobytes())
                progress(n * half * 4)


@dataclass(frozen=True)
class OutputTensor(TensorInfo):
    """One tensor of the output checkpoint: its name, dtype, shape and where its bytes come from."""

    source: TensorSource

    @property
    def nbytes(self) -> int:
        return self.source.nbytes


def _write_order(tensors: Iterable[OutputTensor], key: Callable[[str], object]) -> list[OutputTensor]:
    # Widest elements first, so that with an 8-byte aligned header every tensor is aligned to its
    # element size (what the safetensors library itself does).
    return sorted(tensors, key=lambda t: (-DTYPE_SIZES[t.dtype], key(t.name)))


def split_into_shards(
    tensors: Iterable[OutputTensor], max_shard_size: int | None, key: Callable[[str], object]
) -> list[list[OutputTensor]]:
    """Split the tensors into shards of at most ``max_shard_size`` bytes (a larger tensor gets its own)."""
    shards: list[list[OutputTensor]] = [[]]
    size = 0
    for tensor in _write_order(tensors, key):
        if max_shard_size is not None and shards[-1] and size + tensor.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def shard_file_names(basename: str, count: int) -> list[str]:
    """``<basename>.safetensors``, or ``<basename>-0000i-of-0000n.safetensors`` for several shards."""
    if count == 1:
        return [f"{basename}.safetensors"]
    return [f"{basename}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header_bytes(tensors: Sequence[OutputTensor], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for tensor in tensors:
        expected = math.prod(tensor.shape) * DTYPE_SIZES[tensor.dtype]
        if expected != tensor.nbytes:
            raise ValueError(f"tensor {tensor.name!r}: {tensor.nbytes} bytes for shape {tensor.shape}")
        header[tensor.name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_file(path: Path, tensors: Sequence[OutputTensor], progress: Progress) -> int:
    """Write one safetensors file in the given tensor order; returns its size in bytes."""
    head = _header_bytes(tensors, {"format": "pt"})
    with open(path, "wb", buffering=0) as out:
        _write_all(out, head)
        for tensor in tensors:
            before = out.tell()
            tensor.source.write_to(out, progress)
            if out.tell() - before != tensor.nbytes:
                raise RuntimeError(f"{path}: tensor {tensor.name!r} wrote {out.tell() - before} bytes")
    return len(head) + sum(t.nbytes for t in tensors)


def write_checkpoint(
    directory: Path,
    basename: str,
    shards: Sequence[Sequence[OutputTensor]],
    progress: Progress,
) -> list[str]:
    """Write the shards (and ``<basename>.safetensors.index.json`` when there are several)."""
    names = shard_file_names(basename, len(shards))
    for name, shard in zip(names, shards):
        write_file(directory / name, shard, progress)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for shard in shards for t in shard)},
            "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard},
        }
        (directory / f"{basename}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        names.append(f"{basename}.safetensors.index.json")
    return names
