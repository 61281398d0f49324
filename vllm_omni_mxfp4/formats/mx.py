"""MX block quantization along the last dimension: FP4 (E2M1) or FP8 (E4M3) elements, E8M0 scales.

``quantize_mx`` reproduces the bytes the vendor kernels write (research/kernels.md §1-§2):

1. blocks of ``block_size`` (32) consecutive elements of the last dim; a partial last block is
   treated as zero-padded, as the kernels do;
2. the block maximum ``a`` is taken exactly from the input (float32 bit fields), with the dtype
   rules of :func:`~.scale_rules.block_amax_for_rule`;
3. the E8M0 code comes from ``scale_rule`` (:mod:`.scale_rules`);
4. each element is multiplied by 2^(127 - code) exactly and rounded to the element grid
   (RNE, saturating; FP4 keeps the sign of zero). FLOOR's code 0 zeroes the block (NPU);
   a NaN scale (0xFF) zeroes FP4 elements and makes FP8 elements NaN.

The work is done in row chunks of about 256K elements on CPU so that every intermediate stays in
cache; on other devices the whole tensor is one chunk. Within a chunk everything is vectorised.
"""

from __future__ import annotations

import torch

from .e2m1 import (
    bf16_pattern_to_code_table,
    bf16_pattern_to_value_table,
    bf16_to_code_index,
    byte_to_pair_table,
    fp32_to_code_index,
)
from .scale_rules import (
    FP4_E2M1,
    FP8_E4M3,
    NAN_CODE,
    block_amax_for_rule,
    check_rule,
    e8m0_to_float,
    elem_format,
    recip_scale,
    shared_exponent_codes,
)

MX_BLOCK_SIZE = 32
_CPU_CHUNK_ELEMENTS = 1 << 18
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ABS_MASK = {torch.bfloat16: 0x7FFF, torch.float16: 0x7FFF, torch.float32: 0x7FFFFFFF}
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _check_input(x: torch.Tensor, name: str) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a bfloat16, float16 or float32 tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name}: expected at least one dimension, got a scalar")


def _chunk_rows(rows: int, k_padded: int, device: torch.device) -> int:
    if device.type != "cpu":
        return max(rows, 1)
    return max(1, min(rows, _CPU_CHUNK_ELEMENTS // max(k_padded, 1)))


def block_amax(blocks: torch.Tensor) -> torch.Tensor:
    """float32 maximum of |x| over the last dim, exact, NaN-propagating (NaN > Inf > finite).

    Works on the integer bit patterns: for non-negative IEEE values integer order is value order,
    and every NaN pattern sorts above Inf.
    """
    dtype = blocks.dtype
    mag = blocks.view(_INT_VIEW[dtype]) & _ABS_MASK[dtype]
    top = mag.amax(dim=-1)
    if dtype == torch.float32:
        return top.view(torch.float32)
    return top.view(dtype).float()


def quantize_mx(
    x: torch.Tensor,
    *,
    elem: str = "fp4",
    block_size: int = MX_BLOCK_SIZE,
    scale_rule: str = "floor",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (..., K) to MX along the last dim; returns ``(data, scale)``.

    ``elem="fp4"``: ``data`` is uint8 (..., K/2), two E2M1 codes a byte, even element in the low
    nibble (K must be even). ``elem="fp8"``: ``data`` is float8_e4m3fn (..., K).
    ``scale`` is uint8 E8M0 codes (..., ceil(K/block_size)); a partial last block is handled as if
    zero-padded. ``scale_rule``: ``floor`` | ``uos`` | ``even`` | ``rceil`` | ``aiter_legacy``.
    """
    _check_input(x, "quantize_mx")
    fmt = elem_format(elem)
    check_rule(scale_rule, fmt)
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"quantize_mx: block_size must be a positive even number, got {block_size}")
    k = x.shape[-1]
    if fmt is FP4_E2M1 and k % 2:
        raise ValueError(
            f"quantize_mx: FP4 packs two values a byte, so K must be even; got shape {tuple(x.shape)}"
        )
    groups = -(-k // block_size)
    lead = x.shape[:-1]
    rows = x.numel() // k if k else 0
    flat = x.reshape(rows, k)

    scale = torch.empty((rows, groups), dtype=torch.uint8, device=x.device)
    if fmt is FP4_E2M1:
        data = torch.empty((rows, k // 2), dtype=torch.uint8, device=x.device)
    else:
        data = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    if rows == 0 or k == 0:
        return data.reshape(*lead, data.shape[-1]), scale.reshape(*lead, groups)

    pad = groups * block_size - k
    step = _chunk_rows(rows, k + pad, x.device)
    for start in range(0, rows, step):
        chunk = flat[start : start + step]
        if pad:
            chunk = torch.nn.functional.pad(chunk, (0, pad))
        codes, elems = _quantize_chunk(chunk.reshape(-1, groups, block_size), fmt, scale_rule)
        scale[start : start + step] = codes
        n = chunk.shape[0]
        if fmt is FP4_E2M1:
            nib = elems.reshape(n, groups * block_size)[:, :k]
            data[start : start + step] = nib[:, 0::2] | (nib[:, 1::2] << 4)
        else:
            data[start : start + step] = elems.reshape(n, groups * block_size)[:, :k]
    return data.reshape(*lead, data.shape[-1]), scale.reshape(*lead, groups)


def _quantize_chunk(blocks: torch.Tensor, fmt, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, G, B) floating blocks -> (uint8 codes (R, G), elements (R, G, B))."""
    amax = block_amax_for_rule(block_amax(blocks), blocks.dtype, scale_rule)
    codes = shared_exponent_codes(amax, scale_rule, fmt.name)
    recip = recip_scale(codes, scale_rule).unsqueeze(-1)
    if fmt is FP8_E4M3:
        y = blocks.float() * recip
        elems = y.clamp_(-fmt.max_value, fmt.max_value).to(torch.float8_e4m3fn)
        return codes.to(torch.uint8), elems
    table = bf16_pattern_to_code_table(blocks.device)
    if blocks.dtype == torch.bfloat16:
        # bf16 * 2^k is exact in bf16 unless it underflows, and then it is far below 0.25.
        index = bf16_to_code_index(blocks * recip.to(torch.bfloat16))
    else:
        index = fp32_to_code_index(blocks.float() * recip)
    elems = table.index_select(0, index.reshape(-1)).reshape(blocks.shape)
    return codes.to(torch.uint8), elems


def dequantize_mx(
    data: torch.Tensor,
    scale: torch.Tensor,
    *,
    elem: str = "fp4",
    block_size: int = MX_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Values of MX data: element value x 2^(scale - 127), in ``dtype``; scale 0xFF gives NaN.

    ``data`` is packed uint8 (..., K/2) for fp4 or float8_e4m3fn (..., K) for fp8; ``scale`` is
    uint8 (..., ceil(K/block_size)) (or float8_e8m0fnu). The product is exact in float32, so any
    output dtype sees a single rounding. ``out``: a contiguous (..., K) tensor of ``dtype`` to write
    into (reusing memory avoids the page faults of a fresh large allocation).
    """
    fmt = elem_format(elem)
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        scale = scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise TypeError(f"dequantize_mx: scale must be uint8 E8M0 codes, got {scale.dtype}")
    if fmt is FP4_E2M1:
        if data.dtype != torch.uint8:
            raise TypeError(f"dequantize_mx: fp4 data must be packed uint8, got {data.dtype}")
        k = data.shape[-1] * 2
    else:
        if data.dtype != torch.float8_e4m3fn:
            raise TypeError(f"dequantize_mx: fp8 data must be float8_e4m3fn, got {data.dtype}")
        k = data.shape[-1]
    groups = -(-k // block_size)
    if tuple(scale.shape) != (*data.shape[:-1], groups):
        raise ValueError(
            f"dequantize_mx: scale shape {tuple(scale.shape)} does not match data shape {tuple(data.shape)}; "
            f"expected {(*data.shape[:-1], groups)} for K={k}, block_size={block_size}"
        )
    lead = data.shape[:-1]
    rows = data.numel() // data.shape[-1] if data.shape[-1] else 0
    if out is None:
        result = torch.empty((*lead, k), dtype=dtype, device=data.device)
    else:
        if tuple(out.shape) != (*lead, k) or out.dtype != dtype or out.device != data.device:
            raise ValueError(
                f"dequantize_mx: out must be {dtype} {(*lead, k)} on {data.device}, got {out.dtype} "
                f"{tuple(out.shape)} on {out.device}"
            )
        if not out.is_contiguous():
            raise ValueError("dequantize_mx: out must be contiguous")
        result = out
    out = result.view(rows, k)
    if rows == 0 or k == 0:
        return result
    flat_data = data.reshape(rows, data.shape[-1])
    flat_scale = scale.reshape(rows, groups)
    pad = groups * block_size - k
    # E2M1 values have at most two significant bits and scales are powers of two, so a bf16
    # product equals the float32 product rounded once to bf16: compute bf16 output in bf16.
    compute = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    step = _chunk_rows(rows, k + pad, data.device)
    for start in range(0, rows, step):
        d = flat_data[start : start + step]
        n = d.shape[0]
        s = e8m0_to_float(flat_scale[start : start + step], compute)
        if fmt is FP4_E2M1:
            # One gather of both values of a byte, read as a single 32/64-bit word.
            table = byte_to_pair_table(data.device, compute)
            words = table.view(torch.int32 if compute == torch.bfloat16 else torch.int64).reshape(256)
            vals = words.index_select(0, d.reshape(-1).to(torch.int32)).view(compute).reshape(n, k)
        else:
            vals = d.to(compute)
        if pad:
            vals = torch.nn.functional.pad(vals, (0, pad))
            prod = vals.reshape(n, groups, block_size) * s.unsqueeze(-1)
            out[start : start + step] = prod.reshape(n, groups * block_size)[:, :k]
        elif compute == dtype:
            torch.mul(
                vals.view(n, groups, block_size),
                s.unsqueeze(-1),
                out=out[start : start + step].view(n, groups, block_size),
            )
        else:
            out[start : start + step] = (vals.view(n, groups, block_size) * s.unsqueeze(-1)).view(n, k)
    return result


def fake_quantize_mx(x: torch.Tensor, *, elem: str = "fp4", scale_rule: str = "floor") -> torch.Tensor:
    """Quantize-dequantize: the values ``dequantize_mx(*quantize_mx(x))`` in ``x``'s dtype.

    One pass without packing, for activations in the emulated backend. The result is exact when
    every dequantized value is representable in ``x``'s dtype (always for bf16 and fp32; fp16 can
    underflow for blocks near its range limits).
    """
    _check_input(x, "fake_quantize_mx")
    fmt = elem_format(elem)
    check_rule(scale_rule, fmt)
    k = x.shape[-1]
    groups = -(-k // MX_BLOCK_SIZE)
    pad = groups * MX_BLOCK_SIZE - k
    rows = x.numel() // k if k else 0
    flat = x.reshape(rows, k)
    out = torch.empty_like(flat)
    if rows == 0 or k == 0:
        return out.reshape(x.shape)
    step = _chunk_rows(rows, k + pad, x.device)
    for start in range(0, rows, step):
        chunk = flat[start : start + step]
        if pad:
            chunk = torch.nn.functional.pad(chunk, (0, pad))
        n = chunk.shape[0]
        blocks = chunk.reshape(n, groups, MX_BLOCK_SIZE)
        amax = block_amax_for_rule(block_amax(blocks), blocks.dtype, scale_rule)
        codes = shared_exponent_codes(amax, scale_rule, fmt.name)
        recip = recip_scale(codes, scale_rule).unsqueeze(-1)
        scale = e8m0_to_float(codes).unsqueeze(-1)
        if fmt is FP8_E4M3:
            y = (blocks.float() * recip).clamp_(-fmt.max_value, fmt.max_value).to(torch.float8_e4m3fn)
            values = y.float() * scale
        elif blocks.dtype == torch.bfloat16:
            table = bf16_pattern_to_value_table(blocks.device)
            y = bf16_to_code_index(blocks * recip.to(torch.bfloat16))
            values = table.index_select(0, y.reshape(-1)).view(torch.bfloat16).reshape(blocks.shape)
            values = values * scale.to(torch.bfloat16)
        else:
            table = bf16_pattern_to_value_table(blocks.device)
            y = fp32_to_code_index(blocks.float() * recip)
            values = (
                table.index_select(0, y.reshape(-1)).view(torch.bfloat16).reshape(blocks.shape).float()
                * scale
            )
        values = torch.where(codes.unsqueeze(-1) == NAN_CODE, torch.full_like(values, float("nan")), values)
        out[start : start + step] = values.reshape(n, groups * MX_BLOCK_SIZE)[:, :k]
    return out.reshape(x.shape)


def mx_nan_blocks(scale: torch.Tensor) -> torch.Tensor:
    """Boolean mask of blocks whose scale is the E8M0 NaN code."""
    return scale.view(torch.uint8) == NAN_CODE
