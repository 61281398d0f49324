"""The facts of the MX formats and of a quantized Linear's checkpoint tensors, written once.

Standard library only, so that every layer of the package reads the same table: the runtime loader
(:mod:`vllm_omni_mxfp4.omni`, torch tensors), the kernels (shape checks before a vendor call) and
the merge (:mod:`vllm_omni_mxfp4.checkpoint`, numpy arrays, no torch). A rule that lives here
cannot differ between the code that writes a checkpoint and the code that loads it.

- Constants: block sizes, the E8M0 bias and NaN code, the E2M1 grid, the UOS maximum.
- :class:`CheckpointTensor`: one record per checkpoint tensor of a quantized Linear (name, stored
  dtype, shape as a function of the partition's ``(N, K)``, the axis a row-parallel shard slices and
  how many K elements one index covers there, the value rule).
- :data:`VALUE_RULES`: what a valid value is, as a predicate over an array module (``numpy`` or
  ``torch``), so the loader and the merge flag the same bad values.
- :func:`checkpoint_tensors`: the tensors of each format (``mxfp4``, ``mxfp4_dualscale``, and
  ``mxfp8``: the W8A8 MXFP8 layers a checkpoint lists in ``mxfp8_layers``).
- :func:`low_rank_tensors`: the stored low-rank pair of a Linear that ``svd_lowrank_layers`` lists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# ----------------------------------------------------------------------------------- constants

MX_BLOCK = 32
"""Elements that share one E8M0 scale (OCP MX)."""

DUAL_BLOCK = 512
"""Elements that share one float32 coarse scale in the dual-level (DualScale) format."""

E8M0_BIAS = 127
"""E8M0 code ``c`` encodes ``2 ** (c - E8M0_BIAS)``."""

E8M0_NAN = 0xFF
"""The E8M0 code of a block with a NaN or infinite element; it makes the whole block NaN."""

E8M0_MAX_WEIGHT_CODE = 253
"""The largest E8M0 code a quantizer gives a block of finite weights (BF16, FP16 or FP32: every
magnitude is below ``2 ** 128``): the floor rule gives at most 252 (``floor(log2 amax) - 2``), the
rules that round the exponent up (even, rceil, UOS) 253. Codes 254 (0xFE, ``2 ** 127``) and 255
(NaN) come from no finite weight: a block under 0xFE decodes to at least ``2 ** 126`` per non-zero
element, beyond anything a BF16/FP16 activation can meet without overflow."""

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of the E2M1 codes 0..7; codes 8..15 are the same values negated (sign in bit 3)."""

E2M1_MAX = 6.0
"""The largest E2M1 magnitude."""

E4M3_MAX = 448.0
"""The largest FP8 E4M3 (``float8_e4m3fn``) magnitude."""

E4M3_NAN_MAGNITUDE = 0x7F
"""The magnitude bits (``code & 0x7F``) of FP8 E4M3's only NaN (0x7F and 0xFF; it has no Inf).
Every other magnitude, 0x00..0x7E, is a finite number (0x7E is 448)."""

UOS_DST_TYPE_MAX = 7.25
"""``dst_type_max`` of the NPU's UOS scale rule (``scale_alg=2``) for FP4 E2M1."""

SMOOTH_RANGE = (2.0**-24, 2.0**24)
"""The valid ``mul_scale`` values, ``[2^-24, 2^24]`` (5.96e-8 to 1.68e7). msModelSlim's Smooth
exports ``mul_scale = 1 / clamp(act_max^a / weight_max^(1-a), min=scale_min)`` (iter_smooth,
``scale_min`` 1e-5 by default; SmoothQuant and FlexSmooth clamp at 1e-5 too), so its values are at
most 1e5 and, for activation maxima an FP16 or BF16 activation reaches in a diffusion transformer
(up to about 1e5), at least about 1e-5: the range leaves a margin of about 100 on each side for a
smaller ``scale_min`` or larger maxima. Its lower end is FP16's smallest subnormal (below it
``x * mul_scale`` is zero in FP16); above its upper end the product leaves BF16's and FP16's useful
range for any ordinary activation (1e30 times an activation of 1e9 overflows BF16). A value outside
is a corrupt file or a calibration that diverged, not a Smooth factor."""

NVFP4_BLOCK = 16
"""Elements that share one FP8 E4M3 scale in NVFP4 (the source format of requantization)."""

NVFP4_SCALE_TILE = (128, 4)
"""(rows, scale columns) of one tile of the cuBLAS 2-D blocked ("swizzled") NVFP4 scale layout."""

REQUANT_RULES = ("floor", "even", "rceil", "mse")
"""The E8M0 exponent rules of NVFP4 -> MXFP4 requantization (:mod:`vllm_omni_mxfp4.formats.requant`)."""

REQUANT_DEFAULT_RULE = "mse"
"""The requantization rule ``convert`` and ``nvfp4_requant_rule: auto`` use: the most accurate (never
worse than floor, even or rceil on any block), and every backend runs it, since requantized weights
are data to each kernel."""


LOW_RANK_L1 = "svd_lowrank_l1"
"""A low-rank branch's first factor ``V^T`` ``(rank, K)`` (msModelSlim's ``svd_res`` name)."""

LOW_RANK_L2 = "svd_lowrank_l2"
"""A low-rank branch's second factor ``U * S`` ``(N, rank)`` (msModelSlim's ``svd_res`` name)."""


FORMATS = ("mxfp4", "mxfp4_dualscale", "mxfp8")
"""The quantized Linear formats: one per vLLM-Omni quantization method (``mxfp4``,
``mxfp4_dualscale``), and ``mxfp8``, the W8A8 layers of a checkpoint of either method that its
``mxfp8_layers`` lists (msModelSlim's recipes store some blocks that way)."""

BACKENDS = ("emulated", "npu", "rocm")
"""The hardware a kernel is written for. The kernel registry maps (format, backend) to an
implementation; configs and ``VLLM_OMNI_MXFP4_BACKEND`` accept these names plus ``auto``."""


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers."""
    return -(-a // b)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= value``."""
    return ceil_div(value, multiple) * multiple


# ---------------------------------------------------------------------------------- value rules


@dataclass(frozen=True)
class ValueRule:
    """What a valid value of a tensor is.

    ``bad(values, xp)`` returns a boolean array marking invalid elements, with ``xp`` the array
    module (``numpy`` or ``torch``; both have ``isfinite`` and the operators used). ``expected``
    says in words what a valid value is, and ``cause`` what usually produced an invalid one. Every
    rule marks the values outside one interval (and NaN): a tensor is valid exactly when its minimum
    and maximum are, which lets the loader decide with one ``aminmax`` pass. (``e4m3`` is stated over
    the uint8 codes; on their magnitude bits, ``code & 0x7F``, it is the interval ``[0, 0x7E]``, and
    the loader checks those.)
    """

    name: str
    expected: str
    cause: str
    bad: Callable[[Any, Any], Any]


VALUE_RULES: dict[str, ValueRule] = {
    rule.name: rule
    for rule in (
        ValueRule("any", "any value", "", lambda v, xp: v != v),  # packed FP4 bytes: every byte is valid
        ValueRule(
            "e8m0",
            f"E8M0 codes <= {E8M0_MAX_WEIGHT_CODE} (0x{E8M0_MAX_WEIGHT_CODE:02X}), the largest a quantizer gives "
            "finite weights (0xFF is NaN, 0xFE decodes blocks beyond float range)",
            "a NaN or Inf in the weight when it was quantized, a corrupt file, or scales written with another "
            "bias or byte order (not E8M0 codes)",
            lambda v, xp: v > E8M0_MAX_WEIGHT_CODE,
        ),
        ValueRule(
            "e4m3",
            f"FP8 E4M3 codes other than NaN (0x{E4M3_NAN_MAGNITUDE:02X} / 0x{E4M3_NAN_MAGNITUDE | 0x80:02X})",
            "a NaN in the original weights when they were quantized, or a corrupt file",
            # Over the uint8 codes (numpy reads F8_E4M3 as bytes; torch views float8 as uint8). On the
            # magnitude bits (code & 0x7F) the valid values are the interval [0, 0x7E]: the loader
            # checks those in one pass.
            lambda v, xp: (v & 0x7F) == E4M3_NAN_MAGNITUDE,
        ),
        ValueRule(
            "finite_nonnegative",
            "finite values >= 0",
            "a corrupt file or a calibration that diverged",
            lambda v, xp: ~xp.isfinite(v) | (v < 0),
        ),
        ValueRule(
            "smooth",
            f"finite values in [2^-24, 2^24] ({SMOOTH_RANGE[0]:.3g} to {SMOOTH_RANGE[1]:.3g}), the range of "
            "calibrated Smooth factors (spec.SMOOTH_RANGE)",
            "a corrupt file, a Smooth calibration that divided by zero or diverged, or scales stored in "
            "another form (the reciprocal, a logarithm)",
            lambda v, xp: ~xp.isfinite(v) | ~(v >= SMOOTH_RANGE[0]) | ~(v <= SMOOTH_RANGE[1]),
        ),
        ValueRule(
            "smooth_in_activation_dtype",
            "finite values > 0 in the activation dtype (FP16: 6.0e-8 to 65504)",
            "a Smooth vector calibrated in float32 or BF16 whose range the activation dtype cannot hold; "
            "x * mul_scale runs in that dtype",
            lambda v, xp: ~xp.isfinite(v) | ~(v > 0),
        ),
        ValueRule(
            "e2m1",
            "FP4 E2M1 numbers (0, +-0.5, +-1, +-1.5, +-2, +-3, +-4, +-6)",
            "an ordinary BF16 weight (a layer kept in BF16 but missing from ignored_layers), or values "
            "not unpacked from E2M1 codes",
            lambda v, xp: ~xp.isin(xp.abs(v), xp.asarray(E2M1_VALUES, dtype=v.dtype)),
        ),
        ValueRule(
            "finite",
            "finite values",
            "a NaN or Inf in the original weights, or a corrupt file",
            lambda v, xp: ~xp.isfinite(v),
        ),
    )
}


# ---------------------------------------------------------------------------- checkpoint tensors


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of a quantized Linear in a checkpoint, and its rules.

    ``shape(n, k)`` is the stored shape for a Linear of ``n`` outputs and ``k`` inputs (the whole
    checkpoint tensor, or one partition's share with its block-aligned ``k``). ``k_axis`` is the
    axis that a row-parallel shard slices (``None``: the tensor has no K axis) and ``k_per_index``
    how many K elements one index of that axis covers (2 for packed FP4 bytes, 1 for FP8 elements,
    32 for E8M0 scales, 512 for coarse scales, 1 for the Smooth vector).
    """

    name: str
    dtypes: tuple[str, ...]
    shape_text: str
    shape: Callable[[int, int], tuple[int, ...]]
    k_axis: int | None
    k_per_index: int
    values: str
    required: bool

    @property
    def value_rule(self) -> ValueRule:
        return VALUE_RULES[self.values]

    def k_slice(self, lo: int, hi: int) -> tuple[int, int]:
        """Indices ``[start, stop)`` along :attr:`k_axis` that hold K elements ``[lo, hi)``.

        ``lo`` must be a multiple of :attr:`k_per_index` (a shard's block-aligned start).
        """
        if self.k_axis is None:
            raise ValueError(f"{self.name} has no K axis to shard")
        if lo % self.k_per_index:
            raise ValueError(f"{self.name}: K offset {lo} is not a multiple of {self.k_per_index}")
        return lo // self.k_per_index, ceil_div(hi, self.k_per_index)

    def describe(self) -> str:
        """``weight_scale: U8 (N, ceil(K/32))`` for messages and docs."""
        return f"{self.name}: {' or '.join(self.dtypes)} {self.shape_text}"


FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
"""safetensors dtypes of unquantized floating-point tensors (weights kept in BF16, norms, biases,
Smooth vectors as producers write them): the one list every reader of a checkpoint uses."""

SMOOTH_DTYPES = ("F32", "BF16", "F16")
"""safetensors dtypes a ``mul_scale`` may be stored in (float32 first: what the merge writes)."""

WEIGHT_FP4 = CheckpointTensor(
    "weight", ("U8",), "(N, K/2)", lambda n, k: (n, k // 2), 1, 2, "any", required=True
)
WEIGHT_FP4_NUMERIC = CheckpointTensor(
    "weight", ("BF16", "F16", "F32"), "(N, K)", lambda n, k: (n, k), 1, 1, "e2m1", required=True
)
"""The numeric layout of an FP4 weight: its E2M1 values in a float dtype, unscaled (``merge
--weight-layout numeric``, and vLLM-Omni's single-scale importer, write BF16). The loader packs it."""
WEIGHT_FP8 = CheckpointTensor(
    "weight", ("F8_E4M3",), "(N, K)", lambda n, k: (n, k), 1, 1, "e4m3", required=True
)
WEIGHT_SCALE = CheckpointTensor(
    "weight_scale",
    ("U8",),
    "(N, ceil(K/32))",
    lambda n, k: (n, ceil_div(k, MX_BLOCK)),
    1,
    MX_BLOCK,
    "e8m0",
    required=True,
)
WEIGHT_DUAL_SCALE = CheckpointTensor(
    "weight_dual_scale",
    ("F32",),
    "(N, ceil(K/512), 1)",
    lambda n, k: (n, ceil_div(k, DUAL_BLOCK), 1),
    1,
    DUAL_BLOCK,
    "finite_nonnegative",
    required=True,
)
MUL_SCALE = CheckpointTensor(
    "mul_scale",
    SMOOTH_DTYPES,
    "(K,)",
    lambda n, k: (k,),
    0,
    1,
    "smooth",
    required=False,
)
MUL_SCALE_REQUIRED = CheckpointTensor(
    "mul_scale", MUL_SCALE.dtypes, "(K,)", lambda n, k: (k,), 0, 1, "smooth", required=True
)
BIAS = CheckpointTensor("bias", FLOAT_DTYPES, "(N,)", lambda n, k: (n,), None, 1, "finite", required=False)

LOW_RANK_DTYPES = ("BF16", "F16", "F32")
"""safetensors dtypes a stored low-rank pair may have: msModelSlim's ``svd_res`` writes the pair in its
Linear's original weight dtype (BF16 for the Wan2.2 experts); the runtime computes the branch in the
activation dtype."""


def max_low_rank(rows: int | tuple[int, ...] | list[int], k: int) -> int:
    """The largest rank a low-rank pair of a ``(N, K)`` weight can have, ``min(N, K)``; for a fused
    Linear (``rows`` per piece, each piece its own pair) the smallest piece's."""
    pieces = [rows] if isinstance(rows, int) else list(rows)
    return min(*pieces, k)


def low_rank_tensors(rank: int) -> tuple[CheckpointTensor, CheckpointTensor]:
    """The records of a stored rank-``rank`` low-rank pair (msModelSlim's ``svd_res``):
    ``svd_lowrank_l1 = V^T`` ``(rank, K)``, which a row-parallel shard slices along K like the
    weight, and ``svd_lowrank_l2 = U * S`` ``(N, rank)``, which it keeps whole (a column-parallel shard
    keeps its rows, as of every ``(N, ...)`` tensor). Both must be finite. The pair belongs to a
    quantized Linear of either MXFP4 format; the checkpoint's ``svd_lowrank_layers`` gives each
    Linear's rank."""
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"a low-rank pair needs a rank >= 1, got {rank!r}")
    l1 = CheckpointTensor(
        LOW_RANK_L1, LOW_RANK_DTYPES, f"({rank}, K)", lambda n, k: (rank, k), 1, 1, "finite", required=True
    )
    l2 = CheckpointTensor(
        LOW_RANK_L2, LOW_RANK_DTYPES, f"(N, {rank})", lambda n, k: (n, rank), None, 1, "finite", required=True
    )
    return l1, l2


FORMAT_TENSORS: dict[str, tuple[CheckpointTensor, ...]] = {
    "mxfp4": (WEIGHT_FP4, WEIGHT_SCALE, MUL_SCALE, BIAS),
    "mxfp4_dualscale": (WEIGHT_FP4, WEIGHT_SCALE, WEIGHT_DUAL_SCALE, MUL_SCALE, BIAS),
    "mxfp8": (WEIGHT_FP8, WEIGHT_SCALE, BIAS),
}
"""The checkpoint tensors of each format's quantized Linear. ``mul_scale`` is optional: a layer
without one runs with identity Smooth, which is what msModelSlim computed for a layer it did not
smooth (only its ``NonFusionSmoothQuantWrapper`` multiplies the input, by the ``div.mul_scale`` it
exports; its DualScale and per-block fake-quant Linears quantize ``x`` as it comes, and ``x * 1.0``
is ``x`` in every float dtype). ``mxfp4`` requires it when the config sets
``require_smooth_scale``; an ``mxfp8`` layer has no Smooth."""


FirstBad = Callable[[ValueRule], "tuple[list[int], Any] | None"]
"""Finds the first value a rule marks in a tensor: ``(index, value)``, or None (the caller reads
the tensor its own way: numpy chunks from a file, one torch ``aminmax`` pass in memory)."""


def shown_value(value: Any, codes: bool) -> str:
    """A tensor value as messages show it: ``0xFF`` for codes (uint8, FP8 bytes), else the number."""
    return f"0x{int(value):02X}" if codes else repr(float(value))


def tensor_problem(
    record: CheckpointTensor,
    dtype: str,
    shape: tuple[int, ...],
    expected_shape: tuple[int, ...],
    first_bad: FirstBad | None,
    *,
    dtypes: tuple[str, ...] | None = None,
    codes: bool = False,
) -> str | None:
    """The first problem of one checkpoint tensor against ``record``, in words, or None: its
    safetensors ``dtype`` among ``dtypes`` (default the record's), its ``shape`` equal to
    ``expected_shape`` (the record's shape for the Linear's ``(N, K)``, or a fused piece's), then its
    values by the record's rule (``first_bad`` None: not read; ``codes``: values shown as bytes).
    The one check the merge, ``inspect`` and the runtime loader run; each words where it is."""
    allowed = record.dtypes if dtypes is None else dtypes
    if dtype not in allowed:
        return f"has dtype {dtype}; expected {' or '.join(sorted(allowed))} ({record.describe()})"
    if tuple(shape) != tuple(expected_shape):
        return f"has shape {list(shape)}; expected {list(expected_shape)} {record.shape_text}"
    if first_bad is None or record.values == "any":
        return None
    rule = record.value_rule
    found = first_bad(rule)
    if found is None:
        return None
    at, value = found
    return f"holds {shown_value(value, codes)} at {at}; expected {rule.expected}; usual cause: {rule.cause}"


def checkpoint_tensors(fmt: str) -> tuple[CheckpointTensor, ...]:
    """The checkpoint tensors of format ``fmt``; ``ValueError`` naming the known formats."""
    try:
        return FORMAT_TENSORS[fmt]
    except KeyError:
        raise ValueError(f"unknown MX format {fmt!r}; known: {sorted(FORMAT_TENSORS)}") from None


def checkpoint_tensor(fmt: str, name: str) -> CheckpointTensor:
    """The record of tensor ``name`` in format ``fmt``; ``ValueError`` naming the format's tensors."""
    for tensor in checkpoint_tensors(fmt):
        if tensor.name == name:
            return tensor
    known = [t.name for t in checkpoint_tensors(fmt)]
    raise ValueError(f"{name!r} is not a checkpoint tensor of a {fmt} Linear; expected one of {known}")
