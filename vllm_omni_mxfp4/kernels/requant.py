"""NVFP4 -> MXFP4 requantization, the fast kernel: the bytes and error report of the definition
(:func:`vllm_omni_mxfp4.formats.requant.requantize_nvfp4`) from lookup tables, in row chunks.

What the result is: :mod:`vllm_omni_mxfp4.formats.requant` (the tests hold this kernel to it, byte for
byte). The exponent rules, and what this kernel computes of each:

- ``floor``, ``even``, ``rceil``: the vendor rules of :mod:`.scale_rules` applied to the block
  maximum (``even`` is what SGLang's requantization uses);
- ``mse``: per block, among the exponents ``e0 - 1, e0, e0 + 1`` (``e0`` = the ``floor`` code,
  clamped to 0..254) the one whose quantize-dequantize has the least squared error against the
  float32 block. The set holds every code ``floor``, ``even`` and ``rceil`` can give (``e0`` or
  ``e0 + 1``), so ``mse`` is never worse than any of them on any block. Ties go to ``e0``.
  Only two of the three need computing: with ``a`` = block max / 2^e0 in [4, 8), ``e0 + 1`` can
  only win when ``a > 6`` (below, ``e0``'s grid holds ``e0 + 1``'s on [0, 6 * 2^e0], so no element
  gets closer); closer, it gains only on elements above 7 * 2^e0 (on (6, 7] both round to
  6 * 2^e0), so it can only win when ``a >= 7``. ``e0 - 1`` saturates the maximum at 3 * 2^e0,
  losing at least ``2a - 7 >= 1`` in units of 4^e0, and is finer than ``e0`` only below 2^e0, where
  an element gains at most 1/16 (``e0``'s error there is at most 1/4); so it can only win when
  ``a <= 4.46875`` (31 elements gain at most 1.9375) and, sharper, when the block's elements can
  gain more than 1 in all. The tables hold, per element, an upper bound of that gain in steps of
  1/:data:`GAIN_UNIT`, rounded up, and a block's sum comes with its output bytes. A block is
  therefore requantized at ``e0`` (as ``floor`` would), and only the blocks with ``a >= 7``
  (``e0 + 1``) or with ``a <= 4.46875``, ``e0 > 0`` and a gain bound above 1 (``e0 - 1``) are scored
  at their one other candidate and switched where it is strictly better (:func:`_switch_where_better`):
  the same codes as comparing all three. On real weights the second kind is almost empty, and
  ``mse`` costs about 1.25x ``floor`` (``bench/requant.py``).
  A block ``floor`` reproduces exactly keeps ``floor``'s bytes, so lossless round trips give back
  the original MXFP4 bytes.

How, without a float32 copy of the layer: an element's result depends only on its 4-bit code, its
E4M3 scale byte, the global scale and the block exponent, and within a 16-element half the
exponent matters only through its offset ``d`` from the half's own natural exponent, which can
only take a few values (:data:`SHIFTS`). So one set of tables per global-scale value and the scale
bytes the layer uses, built with the exact dequant and :func:`~.e2m1.e2m1_encode` themselves, maps
``(scale byte, d, input byte)`` to one int32 entry (the output byte, whether it is exact, its
``mse`` gain bound) and to its squared and largest error; requantizing a layer is then one table
gather over its bytes, in row chunks (on the CPU spread over worker threads, :func:`_in_workers`).
The error report needs no per-element work: each chunk counts how often each table entry was used
(one ``bincount``), and the squared error, the input's energy and the largest error of the layer
are read off the tables with those counts. The tests check the result against an independent
float64 reference and against ``quantize_mx`` of the float32 dequant; ``bench/requant.py``
measures it against BF16 -> MXFP4 quantization.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_omni_mxfp4 import spec

from ..formats.e2m1 import e2m1_decode, e2m1_encode, pack_fp4
from ..formats.nvfp4 import Nvfp4Weight, dequantize_nvfp4, row_slices
from ..formats.requant import RequantError, Requantized, check_rule, check_scales
from ..formats.scale_rules import e8m0_to_float, shared_exponent_codes

MX_BLOCK = spec.MX_BLOCK
HALF = spec.NVFP4_BLOCK
SHIFTS = tuple(range(-6, 6))
"""Offsets ``d`` = block exponent - the half's natural exponent (the ``floor`` code of 6 * s * g).
A block exponent is at least ``floor(amax) - 1`` and a nonzero half's amax is at least 1/12 of its
6 * s * g, so ``d >= -5`` (``-6`` is there for ``mse``'s lower candidate); the half's elements are
below 2^(3 - d) times the block scale, so from ``d = 5`` on all of them round to +-0: larger
offsets are looked up at ``d = 5`` (:data:`TOP`)."""
TOP = len(SHIFTS) - 1
SLOTS = len(SHIFTS) + 1
ZEROED = len(SHIFTS)
"""The last slot: FLOOR's zeroed blocks (code 0)."""
GAIN_UNIT = 128
"""``mse``'s lower candidate ``e0 - 1`` is scored only where the block's bound on what it can gain
exceeds one unit of the block scale squared (module docstring); the bound is kept per element in
steps of 1 / GAIN_UNIT, rounded up, so at most GAIN_UNIT / 16 + 1 per element."""
MAX_ELEMENT_UNITS = GAIN_UNIT // 16 + 1
INEXACT = 512
"""Weight of an inexact byte in a block's flag sum: above any block's gain units (32 x 9 = 288)."""
CHUNK_ELEMENTS = 1 << 20
"""Weights per row chunk. A chunk's temporaries (about 14 bytes a weight: int32 byte indices and
table entries) outgrow the cache, but the ops stream through them, and larger chunks mean fewer
ops: per-op dispatch, under the GIL, is what bounds the worker threads (``bench/requant.py``)."""
FLAG_SHIFT = 16
"""Where a table entry's flags start: a block's 16 output bytes sum below 2^16, so one int32 sum
over the block's entries carries its flag sum unmixed above them."""


# ------------------------------------------------------------------------------------ tables


@dataclass(frozen=True)
class _Tables:
    """Lookup tables for one global scale and the scale bytes a layer uses (module docstring).

    ``remap`` (256,): scale byte -> its row in the other tables (only the bytes the layer uses get
    rows, so building them is cheap and they stay in cache). ``half_codes`` (rows * 8): the E8M0
    code of the rule of a 16-half whose largest magnitude code is that one; every rule's code grows
    with the block maximum, so a block's code is the larger of its halves' (no float maximum, no
    rule per block). For ``mse`` the entry is ``floor code * 4 + side``, ``side`` 2 when the
    maximum is at least 7 * 2^(code - 127) (``e0 + 1`` may win), 0 when it is at most 4.46875 *
    2^(code - 127) and the code is not 0 (``e0 - 1`` may win), else 1; ``side`` grows with the
    maximum, so the larger of a block's two entries also says which neighbour of ``e0`` to score
    (module docstring). ``natural`` (rows,): the half's natural exponent.

    Per (row, slot, input byte), flat so that one int32 index serves them all: ``out`` int32, the
    output byte plus, from bit :data:`FLAG_SHIFT`, flags (one gather gives both): :data:`INEXACT`
    if either element is inexact, plus, for ``mse``, the byte's gain units (module docstring);
    ``sse`` float64 squared error; ``max_err`` float32 largest |error|. ``ref2`` (rows, 256):
    float64 sum of squares of the input byte's two elements.
    """

    remap: torch.Tensor
    half_codes: torch.Tensor
    natural: torch.Tensor
    out: torch.Tensor
    sse: torch.Tensor
    max_err: torch.Tensor
    ref2: torch.Tensor

    @property
    def entries(self) -> int:
        """Number of (row, slot, byte) entries: the range of a byte index."""
        return self.out.numel()


def _codes_of_slots(natural: torch.Tensor) -> torch.Tensor:
    """int32 E8M0 codes ``(rows, len(SHIFTS))`` of every (table row, slot) but the zeroed one."""
    return (natural.unsqueeze(1) + torch.tensor(SHIFTS, dtype=torch.int32)).clamp(0, 254)


def _element_tables(values: torch.Tensor, natural: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 codes and float32 errors ``(rows, slots, 16)`` of every (scale byte, slot, code)."""
    code = _codes_of_slots(natural).unsqueeze(-1)  # (rows, shifts, 1)
    x = values.unsqueeze(1)  # (rows, 1, 16)
    q = e2m1_encode(x * e8m0_to_float(254 - code))  # x * 2^(127 - code), exact
    err = e2m1_decode(q) * e8m0_to_float(code) - x
    q_zero = e2m1_encode(x * 0.0)  # FLOOR's code 0 zeroes the block, keeping each sign
    return torch.cat((q, q_zero), dim=1), torch.cat((err, -x), dim=1)


def _gain_units(err: torch.Tensor, natural: torch.Tensor) -> torch.Tensor:
    """int32 ``(rows, slots, 16)``: per element, an upper bound, in 1 / :data:`GAIN_UNIT` of the
    block scale squared, of what its squared error drops from a slot's exponent to the one below
    (0 where it does not drop). At most :data:`MAX_ELEMENT_UNITS` (a drop is at most 1/16: module
    docstring); slot 0 has no slot below and is never a block's ``e0`` slot, the zeroed slot is
    not ``mse``'s: both get 0."""
    e = err[:, : len(SHIFTS)].double().square()
    scale = torch.exp2(-2.0 * (_codes_of_slots(natural)[:, 1:] - 127).double()).unsqueeze(-1)
    drop = (e[:, 1:] - e[:, :-1]) * scale
    units = torch.where(drop > 0, torch.floor(drop * GAIN_UNIT * (1 + 2.0**-20)) + 1, 0.0)
    if float(units.max()) > MAX_ELEMENT_UNITS:  # would overflow a block's flag sum into the inexact count
        raise RuntimeError("internal: an element's error drop exceeds 1/16 of the block scale squared")
    zero = torch.zeros_like(units[:, :1])
    return torch.cat((zero, units, zero), dim=1).int()


def _bytes(low: torch.Tensor, high: torch.Tensor, op) -> torch.Tensor:
    """``(..., 16)`` per-code tables combined into ``(..., 256)`` per-byte ones:
    ``op(low[byte & 15], high[byte >> 4])`` (broadcast, so no gathers)."""
    return op(low.unsqueeze(-2), high.unsqueeze(-1)).flatten(-2)


def _half_codes(values: torch.Tensor, rule: str) -> torch.Tensor:
    """``(rows * 8,)`` int32 :attr:`_Tables.half_codes` of the magnitudes ``values`` ``(rows, 8)``."""
    amax = values.abs().flatten()
    if rule != "mse":
        return shared_exponent_codes(amax, rule)
    e0 = shared_exponent_codes(amax, "floor")
    scale = e8m0_to_float(e0)
    side = 1 + (amax >= 7 * scale).int() - ((amax <= 4.46875 * scale) & (e0 > 0)).int()
    return e0 * 4 + side


def _check_range(name: str, used: torch.Tensor, values: torch.Tensor, natural: torch.Tensor) -> None:
    """Refuse scale bytes whose 6 * s * g is nonzero but below 2^-124 or at least 2^123: a slot's
    code would leave 0..254 there, and the tables do not hold."""
    bad = ((natural == 0) & (values[:, 7] != 0)) | (natural > 247)  # 6 * s * g >= 2^123
    if bool(bad.any()):
        byte = int(used[bad.nonzero()[0, 0]])
        raise ValueError(
            f"{name}: 6 x block scale x global scale outside [2^-124, 2^123) (scale byte 0x{byte:02X}; "
            "weights near the float32 limits) cannot be requantized; keep this layer unquantized"
        )


def _tables(
    name: str, g: float, divides: bool, used: torch.Tensor, device: torch.device, rule: str
) -> _Tables:
    """The tables of global scale ``g`` (a multiplier, or a divisor with ``divides``) for the scale
    bytes ``used`` (uint8, CPU), built with the exact dequant of every (scale byte, code) pair. About
    60 kB per byte used, built per call in a few milliseconds and not cached:
    every layer has its own global scale."""
    rows = used.numel()
    codes = pack_fp4(torch.arange(16, dtype=torch.uint8).expand(rows, 16))
    scales = used.reshape(rows, 1).view(torch.float8_e4m3fn)
    values = dequantize_nvfp4(Nvfp4Weight(codes, scales, torch.tensor(g, dtype=torch.float32), divides))
    natural = shared_exponent_codes(values[:, 7].abs(), "floor")
    _check_range(name, used, values, natural)
    q, err = _element_tables(values, natural)
    inexact = (err != 0).int()
    flags = _bytes(inexact, inexact, torch.bitwise_or) * INEXACT
    if rule == "mse":
        units = _gain_units(err, natural)
        flags += _bytes(units, units, torch.add)
    out = _bytes(q, q << 4, torch.bitwise_or).int() | (flags << FLAG_SHIFT)
    e2, a, v2 = err.double().square(), err.abs(), values.double().square()
    remap = torch.zeros(256, dtype=torch.int32)
    remap[used.long()] = torch.arange(rows, dtype=torch.int32)
    tables = (
        remap, _half_codes(values[:, :8], rule), natural, out.reshape(-1),
        _bytes(e2, e2, torch.add).reshape(-1), _bytes(a, a, torch.maximum).reshape(-1), _bytes(v2, v2, torch.add),
    )  # fmt: skip
    return _Tables(*(t.to(device) for t in tables))


# ---------------------------------------------------------------------------- one row chunk


def _gather(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table.flatten()[index]`` for an int32 index tensor of any shape (half the index traffic of
    int64; every table has fewer than 2^31 entries)."""
    return table.reshape(-1).index_select(0, index.reshape(-1)).reshape(index.shape)


def _block_codes(t: _Tables, data: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """int32 ``(R, G)`` :attr:`_Tables.half_codes` entries of blocks from bytes ``(R, 2G, 8)``
    (uint8) and table rows ``(R, 2G)``: the larger of each block's two halves' entries."""
    mag = _largest_of_8(torch.maximum(data & 7, (data >> 4) & 7))  # each half's largest magnitude code
    return _gather(t.half_codes, row * 8 + mag).reshape(row.shape[0], -1, 2).amax(dim=-1)


def _largest_of_8(x: torch.Tensor) -> torch.Tensor:
    """``x.amax(dim=-1)`` of a ``(..., 8)`` tensor as seven elementwise maxima of its columns: a
    reduction over 8 innermost elements runs about 1.5x slower in torch."""
    c = x.unbind(-1)
    return torch.maximum(
        torch.maximum(torch.maximum(c[0], c[1]), torch.maximum(c[2], c[3])),
        torch.maximum(torch.maximum(c[4], c[5]), torch.maximum(c[6], c[7])),
    )


def _slots(code: torch.Tensor, natural: torch.Tensor) -> torch.Tensor:
    """int32 slots ``(R, 2G)`` of the halves (natural exponents ``natural``) of blocks with E8M0
    codes ``code`` ``(R, G)``: slots from :data:`TOP` on all give zeros, so they clamp there."""
    return (code.repeat_interleave(2, dim=1) - natural - SHIFTS[0]).clamp_(0, TOP)


PAIR = (1 << 32) + 1
"""An int32 value times PAIR, as an int64, holds it in both halves: added to two adjacent int32
values viewed as one int64, it adds to each (no carry crosses: every index is below 2^31), on
either byte order."""


def _byte_index(row: torch.Tensor, slot: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """int32 flat table index ``(R, 2G, 8)`` of every byte (``data`` uint8) of halves whose table
    rows and slots are ``row`` / ``slot`` ``(R, 2G)``."""
    index = data.int()
    base = ((row * SLOTS + slot) * 256).long() * PAIR  # the half's base in both int32s of an int64
    index.view(torch.int64).add_(base.unsqueeze(-1))  # 4 adds of a pair per half, not 8 broadcast ones
    return index


def _switch_where_better(t: _Tables, blocks: torch.Tensor, side, natural, result) -> int:
    """Score ``blocks`` (flat block ids of the chunk) at their other candidate (``side``: 2 above
    ``e0``, 0 below) and write the ones it improves strictly into ``result`` = (codes ``(R, G)``,
    slots ``(R, 2G)``, byte indices and :attr:`_Tables.out` entries ``(R, 2G, 8)``) in place.
    Returns how many switched blocks are exact."""
    code, slot, index, entries = result
    other = code.reshape(-1).index_select(0, blocks) + side.reshape(-1).index_select(0, blocks) - 1
    halves = natural.reshape(-1, 2).index_select(0, blocks)
    moved = (other.unsqueeze(1) - halves - SHIFTS[0]).clamp_(0, TOP) - slot.reshape(-1, 2).index_select(
        0, blocks
    )
    at_e0 = index.reshape(-1, 2, HALF // 2).index_select(0, blocks)
    at_other = at_e0 + (moved * 256).unsqueeze(-1)
    before = _gather(t.sse, at_e0).reshape(-1, MX_BLOCK // 2).sum(dim=-1)
    after = _gather(t.sse, at_other).reshape(-1, MX_BLOCK // 2).sum(dim=-1)
    better = (after < before).nonzero().squeeze(1)
    if not better.numel():
        return 0
    switched = blocks.index_select(0, better)
    code.view(-1).index_copy_(0, switched, other.index_select(0, better))
    chosen = at_other.index_select(0, better).reshape(-1, MX_BLOCK // 2)
    index.view(-1, MX_BLOCK // 2).index_copy_(0, switched, chosen)
    entries.view(-1, MX_BLOCK // 2).index_copy_(0, switched, _gather(t.out, chosen))
    return int((after.index_select(0, better) == 0).sum())


@dataclass
class _Counts:
    """One worker's tallies over its row chunks of one row group: how often each table entry was
    used (the error report is computed from these and the tables), exact blocks, all blocks."""

    entries: torch.Tensor
    exact: int = 0
    blocks: int = 0

    def add(self, index: torch.Tensor, exact: int, blocks: int) -> None:
        self.entries += torch.bincount(index.reshape(-1), minlength=self.entries.numel())
        self.exact, self.blocks = self.exact + exact, self.blocks + blocks

    def merge(self, other: _Counts) -> None:
        """Add another worker's tallies."""
        self.entries += other.entries
        self.exact, self.blocks = self.exact + other.exact, self.blocks + other.blocks


@dataclass
class _ErrorSums:
    """The error report's sums over the row groups (squares summed in float64)."""

    err2: float = 0.0
    ref2: float = 0.0
    max_abs: float = 0.0
    exact: int = 0
    blocks: int = 0

    def add(self, t: _Tables, counts: _Counts) -> None:
        """Add a row group requantized through ``t``, with the tallies ``counts``."""
        used = counts.entries.double()
        self.err2 += float(used @ t.sse)
        self.ref2 += float((used.view(-1, SLOTS, 256).sum(dim=1) * t.ref2).sum())
        largest = t.max_err[counts.entries > 0]
        self.max_abs = max(self.max_abs, float(largest.max()) if largest.numel() else 0.0)
        self.exact, self.blocks = self.exact + counts.exact, self.blocks + counts.blocks

    def report(self, name: str, rule: str) -> RequantError:
        rel = math.sqrt(self.err2 / self.ref2) if self.ref2 else math.sqrt(self.err2)
        return RequantError(name, rule, rel, self.max_abs, self.exact, self.blocks)


def _requant_chunk(t: _Tables, codes: torch.Tensor, scales: torch.Tensor, rule: str, counts: _Counts):
    """MXFP4 ``(data (R, K/2), scale (R, G))`` of NVFP4 rows ``codes`` / scale bytes ``scales``;
    ``data`` is the :attr:`_Tables.out` entries, whose low byte the caller's uint8 copy keeps
    (integer conversion to uint8 is modulo 256)."""
    r, half_k = codes.shape
    groups = spec.ceil_div(half_k * 2, MX_BLOCK)
    pad = groups * MX_BLOCK // 2 - half_k
    row = _gather(t.remap, scales.int())
    if pad:  # a partial last MX block: one more half of zero codes with scale byte 0
        codes = torch.nn.functional.pad(codes, (0, pad))
        row = torch.nn.functional.pad(row, (0, 1), value=int(t.remap[0]))
    data = codes.reshape(r, 2 * groups, HALF // 2)
    key = _block_codes(t, data, row)
    natural = _gather(t.natural, row)
    code = key >> 2 if rule == "mse" else key
    slot = _slots(code, natural)
    if rule == "floor":  # quantize_mx's FLOOR: code 0 zeroes the block, keeping each sign
        slot = torch.where((code == 0).repeat_interleave(2, dim=1), ZEROED, slot)
    index = _byte_index(row, slot, data)
    entries = _gather(t.out, index)
    flags = entries.view(r, groups, MX_BLOCK // 2).sum(dim=-1) >> FLAG_SHIFT
    exact = int((flags < INEXACT).sum())
    if rule == "mse":
        side = key & 3
        may_drop = (side == 0) & ((flags & (INEXACT - 1)) > GAIN_UNIT)
        blocks = ((side == 2) | may_drop).reshape(-1).nonzero().squeeze(1)
        if blocks.numel():
            exact += _switch_where_better(t, blocks, side, natural, (code, slot, index, entries))
    counts.add(index, exact, r * groups)
    return entries.view(r, -1)[:, :half_k], code.to(torch.uint8)


# ------------------------------------------------------------------------------------ public


def _row_groups(w: Nvfp4Weight) -> list[tuple[float, torch.Tensor | None]]:
    """(global scale, rows having it) pairs; ``None`` rows = all rows (a per-tensor scale)."""
    if w.global_scale.dim() == 0:
        return [(float(w.global_scale), None)]
    values, inverse = torch.unique(w.global_scale, return_inverse=True)
    return [(float(v), (inverse == i).nonzero().squeeze(1)) for i, v in enumerate(values.tolist())]


def _used_bytes(scale_bytes: torch.Tensor) -> torch.Tensor:
    """The distinct scale bytes of a layer, and 0 (a partial block's padding), as a uint8 CPU tensor."""
    count = torch.bincount(scale_bytes.reshape(-1), minlength=256)
    count[0] = 1
    return count.nonzero().squeeze(1).to(device="cpu", dtype=torch.uint8)


def _in_workers(work: Callable[[list[slice]], _Counts], chunks: list[slice], workers: int) -> _Counts:
    """``work`` over ``chunks``, split across ``workers`` threads (1: here, in order).

    The per-chunk ops are many and small, so on a CPU splitting chunks over threads that each run
    single-threaded ops beats splitting every op over OpenMP threads (``bench/requant.py``). This
    function changes no thread setting: a caller that asks for workers runs with one intra-op thread
    (the ``convert`` command line sets it; the engine loads with ``workers=1`` and its own threads).
    """
    n = min(workers, len(chunks))
    if n < 2:
        return work(chunks)
    shares = [chunks[i * len(chunks) // n : (i + 1) * len(chunks) // n] for i in range(n)]
    results: list[_Counts | BaseException | None] = [None] * n

    def run(i: int) -> None:
        try:
            results[i] = work(shares[i])
        except BaseException as exc:  # re-raised in the caller's thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), name=f"vllm-omni-mxfp4-requant-{i}") for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    total = results[0]
    for result in results[1:]:
        total.merge(result)
    return total


def requantize_nvfp4(w: Nvfp4Weight, rule: str = "mse", *, workers: int = 1) -> Requantized:
    """Requantize an NVFP4 weight to MXFP4 under ``rule``: the bytes and report of
    :func:`vllm_omni_mxfp4.formats.requant.requantize_nvfp4`, computed from tables in row chunks;
    ``workers`` > 1 splits the chunks over that many threads on the CPU (:func:`_in_workers`)."""
    check_rule(rule)
    check_scales(w)
    n, k = w.shape
    device = w.codes.device
    data = torch.empty((n, k // 2), dtype=torch.uint8, device=device)
    scale = torch.empty((n, spec.ceil_div(k, MX_BLOCK)), dtype=torch.uint8, device=device)
    sums = _ErrorSums()
    scale_bytes = w.scales.view(torch.uint8)
    for g, rows in _row_groups(w):
        codes = w.codes if rows is None else w.codes.index_select(0, rows)
        sbytes = scale_bytes if rows is None else scale_bytes.index_select(0, rows)
        t = _tables(w.name, g, w.global_divides, _used_bytes(sbytes), device, rule)

        def work(chunks: list[slice], t=t, codes=codes, sbytes=sbytes, rows=rows) -> _Counts:
            part = _Counts(torch.zeros(t.entries, dtype=torch.int64, device=device))
            for chunk in chunks:
                out, code = _requant_chunk(t, codes[chunk], sbytes[chunk], rule, part)
                if rows is None:
                    data[chunk].copy_(out)  # keeps each entry's low byte
                    scale[chunk] = code
                else:
                    data.index_copy_(0, rows[chunk], out.to(torch.uint8))
                    scale.index_copy_(0, rows[chunk], code)
            return part

        chunks = list(row_slices(codes.shape[0], k, CHUNK_ELEMENTS))
        sums.add(t, _in_workers(work, chunks, workers if device.type == "cpu" else 1))
    return Requantized(data, scale, sums.report(w.name, rule))
