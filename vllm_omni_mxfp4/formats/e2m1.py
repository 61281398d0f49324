"""FP4 E2M1 element encoding, decoding and nibble packing.

E2M1 has one sign bit, two exponent bits (bias 1) and one mantissa bit: the magnitudes
{0, 0.5, 1, 1.5, 2, 3, 4, 6}, code = sign * 8 + index in that list. There is no Inf and no NaN.

Encoding rounds to nearest, ties to even code, and saturates to +-6 (what torch_npu
``round_mode="rint"``, AITER and torchao do). The sign of the input is kept, so negative values
that round to zero become -0 (code 0x8), as a hardware cast does. NaN encodes as +0: a block holding
a NaN gets the NaN scale (0xFF) and decodes to NaN whatever its elements are.

Packing puts two codes in a byte along the last dimension, the even (first) element in the low
nibble: the layout of torch ``float4_e2m1fn_x2``, msModelSlim, torch_npu and AITER.
"""

from __future__ import annotations

import functools

import torch

from vllm_omni_mxfp4 import spec

E2M1_MAX = spec.E2M1_MAX

#: The eight E2M1 magnitudes, indexed by the low three bits of a code.
E2M1_VALUES: tuple[float, ...] = spec.E2M1_VALUES

# Decision thresholds between neighbouring magnitudes: their midpoints. A tie rounds to the even
# code: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0. ``True``
# means the threshold itself rounds up (the upper neighbour has the even code).
_THRESHOLDS: tuple[tuple[float, bool], ...] = tuple(
    ((low + high) / 2, upper % 2 == 0)
    for upper, (low, high) in enumerate(zip(E2M1_VALUES, E2M1_VALUES[1:]), start=1)
)


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to E2M1 codes (uint8 0..15), RNE with saturation to +-6.

    Exact for any floating dtype: the comparisons are done in the input's own precision, in which
    every threshold is representable.
    """
    a = y.abs()
    idx = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for threshold, up in _THRESHOLDS:
        idx += (a >= threshold) if up else (a > threshold)
    idx = torch.where(torch.isnan(y), torch.zeros_like(idx), idx)
    sign = torch.signbit(y) & ~torch.isnan(y)
    return idx | (sign.to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of E2M1 codes (uint8 0..15) in ``dtype``; code 8 decodes to -0.0."""
    return _decode_table(codes.device, dtype)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes (..., K) uint8 into bytes (..., K/2), even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: the last dimension must be even, got shape {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes (..., K/2) into E2M1 codes (..., K) uint8; inverse of :func:`pack_fp4`."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_fp4: expected packed uint8 data, got {packed.dtype}")
    out = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


@functools.cache
def _decode_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    table = torch.cat((mags, -mags))
    return table.to(device=device, dtype=dtype)


@functools.cache
def bf16_pattern_to_code_table(device: torch.device) -> torch.Tensor:
    """uint8 table of 65536 entries: E2M1 code of the bfloat16 value with that bit pattern.

    The fast encoder indexes it with scaled bf16 bit patterns. For fp32 values it is indexed with
    the top 16 bits plus a sticky bit (see :func:`fp32_to_code_index`), which keeps RNE exact.
    """
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.uint16).view(torch.bfloat16)
    return e2m1_encode(patterns.float()).to(device)


@functools.cache
def bf16_pattern_to_value_table(device: torch.device) -> torch.Tensor:
    """int16 table of 65536 entries: bf16 bit pattern of the E2M1 value nearest each bf16 value.

    Used by the fused quantize-dequantize path, which never materialises codes.
    """
    codes = bf16_pattern_to_code_table(torch.device("cpu"))
    values = _decode_table(torch.device("cpu"), torch.float32)[codes.long()].to(torch.bfloat16)
    return values.view(torch.int16).to(device)


@functools.cache
def byte_to_pair_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(256, 2) table: the two E2M1 values of a packed byte (low nibble first), in ``dtype``."""
    byte = torch.arange(256, dtype=torch.int32)
    codes = torch.stack((byte & 0xF, byte >> 4), dim=-1)
    return _decode_table(torch.device("cpu"), torch.float32)[codes].to(device=device, dtype=dtype)


def bf16_to_code_index(y: torch.Tensor) -> torch.Tensor:
    """Int32 table index (0..65535) of bfloat16 values."""
    return y.view(torch.uint16).to(torch.int32)


def fp32_to_code_index(y: torch.Tensor) -> torch.Tensor:
    """Int32 table index of float32 values: top 16 bits, the discarded bits OR-ed into bit 0.

    E2M1 rounding looks at one kept mantissa bit, one round bit and a sticky bit; the bf16 pattern
    keeps seven mantissa bits, so folding the lower 16 bits into its last bit decides every tie and
    every near-tie exactly as the full float32 value would.
    """
    u = y.view(torch.int32)
    sticky = (u & 0xFFFF) != 0
    return ((u >> 16) & 0xFFFF) | sticky.to(torch.int32)
