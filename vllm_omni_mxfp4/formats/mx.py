"""MX block quantization along the last dimension: FP4 (E2M1) or FP8 (E4M3) elements, E8M0 scales.

``quantize_mx`` reproduces the bytes the vendor kernels write (docs/kernels.md):

1. blocks of ``block_size`` (32) consecutive elements of the last dim; a partial last block is
   treated as zero-padded, as the kernels do;
2. the block maximum ``a`` is taken exactly from the input (float32 bit fields), with the dtype
   rules of :func:`~.scale_rules.block_amax_for_rule`;
3. the E8M0 code comes from ``scale_rule`` (:mod:`.scale_rules`);
4. each element is multiplied by 2^(127 - code) exactly and rounded to the element grid
   (RNE, saturating; FP4 keeps the sign of zero). FLOOR's code 0 zeroes the block (NPU);
   a NaN scale (0xFF) zeroes FP4 elements and makes FP8 elements NaN.

``fake_quantize_mx`` runs steps 1-4 and multiplies back without packing. Rows are processed in
chunks (:mod:`.rows`); within a chunk everything is vectorised.
"""

from __future__ import annotations

import torch

from vllm_omni_mxfp4 import spec

from .e2m1 import (
    bf16_pattern_to_code_table,
    bf16_pattern_to_value_table,
    bf16_to_code_index,
    byte_to_pair_table,
    fp32_to_code_index,
)
from .rows import check_float_input, from_blocks, row_chunks, row_count, to_blocks
from .scale_rules import (
    FP4_E2M1,
    FP8_E4M3,
    NAN_CODE,
    ElemFormat,
    block_amax_for_rule,
    check_rule,
    e8m0_to_float,
    elem_format,
    recip_scale,
    shared_exponent_codes,
)

MX_BLOCK_SIZE = spec.MX_BLOCK
_ABS_MASK = {torch.bfloat16: 0x7FFF, torch.float16: 0x7FFF, torch.float32: 0x7FFFFFFF}
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


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


# ------------------------------------------------------------------------- the shared pipeline


def _block_scales(
    blocks: torch.Tensor, fmt: ElemFormat, scale_rule: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2-3 for ``(R, G, B)`` blocks: int32 E8M0 codes ``(R, G)`` and the float32 multipliers
    2^(127 - code) ``(R, G, 1)`` that map each block onto the element grid."""
    amax = block_amax_for_rule(block_amax(blocks), blocks.dtype, scale_rule)
    codes = shared_exponent_codes(amax, scale_rule, fmt.name)
    return codes, recip_scale(codes, scale_rule).unsqueeze(-1)


def _fp4_grid_index(blocks: torch.Tensor, recip: torch.Tensor) -> torch.Tensor:
    """Step 4 for FP4: the scaled elements as indices into the bf16-pattern tables of :mod:`.e2m1`."""
    if blocks.dtype == torch.bfloat16:
        # bf16 * 2^k is exact in bf16 unless it underflows, and then it is far below 0.25.
        return bf16_to_code_index(blocks * recip.to(torch.bfloat16)).reshape(-1)
    return fp32_to_code_index(blocks.float() * recip).reshape(-1)


def _fp8_elements(blocks: torch.Tensor, recip: torch.Tensor, fmt: ElemFormat) -> torch.Tensor:
    """Step 4 for FP8: the scaled elements rounded to E4M3, saturating."""
    return (blocks.float() * recip).clamp_(-fmt.max_value, fmt.max_value).to(torch.float8_e4m3fn)


def _quantize_blocks(
    blocks: torch.Tensor, fmt: ElemFormat, scale_rule: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, G, B) floating blocks -> (uint8 codes (R, G), elements (R, G, B): E2M1 codes or E4M3)."""
    codes, recip = _block_scales(blocks, fmt, scale_rule)
    if fmt is FP8_E4M3:
        return codes.to(torch.uint8), _fp8_elements(blocks, recip, fmt)
    table = bf16_pattern_to_code_table(blocks.device)
    elems = table.index_select(0, _fp4_grid_index(blocks, recip)).reshape(blocks.shape)
    return codes.to(torch.uint8), elems


def _fake_quantize_blocks(blocks: torch.Tensor, fmt: ElemFormat, scale_rule: str) -> torch.Tensor:
    """(R, G, B) floating blocks -> their quantize-dequantize values, in the blocks' dtype."""
    codes, recip = _block_scales(blocks, fmt, scale_rule)
    scale = e8m0_to_float(codes).unsqueeze(-1)
    if fmt is FP8_E4M3:
        values = _fp8_elements(blocks, recip, fmt).float() * scale
    else:
        table = bf16_pattern_to_value_table(blocks.device)
        grid = (
            table.index_select(0, _fp4_grid_index(blocks, recip)).view(torch.bfloat16).reshape(blocks.shape)
        )
        if blocks.dtype == torch.bfloat16:
            values = grid * scale.to(torch.bfloat16)
        else:
            values = grid.float() * scale
    return torch.where(codes.unsqueeze(-1) == NAN_CODE, torch.full_like(values, float("nan")), values)


def _checked_format(x: torch.Tensor, elem: str, scale_rule: str, name: str) -> ElemFormat:
    check_float_input(x, name)
    fmt = elem_format(elem)
    check_rule(scale_rule, fmt)
    return fmt


# ------------------------------------------------------------------------------------ public


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
    fmt = _checked_format(x, elem, scale_rule, "quantize_mx")
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"quantize_mx: block_size must be a positive even number, got {block_size}")
    k = x.shape[-1]
    if fmt is FP4_E2M1 and k % 2:
        raise ValueError(
            f"quantize_mx: FP4 packs two values a byte, so K must be even; got shape {tuple(x.shape)}"
        )
    groups = spec.ceil_div(k, block_size)
    rows = row_count(x)
    flat = x.reshape(rows, k)
    scale = torch.empty((rows, groups), dtype=torch.uint8, device=x.device)
    if fmt is FP4_E2M1:
        data = torch.empty((rows, k // 2), dtype=torch.uint8, device=x.device)
    else:
        data = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    for rows_at in row_chunks(rows, groups * block_size, x.device):
        codes, elems = _quantize_blocks(to_blocks(flat[rows_at], groups, block_size), fmt, scale_rule)
        scale[rows_at] = codes
        elems = from_blocks(elems, k)
        if fmt is FP4_E2M1:
            elems = elems[:, 0::2] | (elems[:, 1::2] << 4)
        data[rows_at] = elems
    return data.reshape(*x.shape[:-1], data.shape[-1]), scale.reshape(*x.shape[:-1], groups)


def fake_quantize_mx(x: torch.Tensor, *, elem: str = "fp4", scale_rule: str = "floor") -> torch.Tensor:
    """Quantize-dequantize: the values ``dequantize_mx(*quantize_mx(x))`` in ``x``'s dtype.

    One pass without packing, for activations in the emulated backend. The result is exact when
    every dequantized value is representable in ``x``'s dtype (always for bf16 and fp32; fp16 can
    underflow for blocks near its range limits).
    """
    fmt = _checked_format(x, elem, scale_rule, "fake_quantize_mx")
    k = x.shape[-1]
    groups = spec.ceil_div(k, MX_BLOCK_SIZE)
    rows = row_count(x)
    flat = x.reshape(rows, k)
    out = torch.empty_like(flat)
    for rows_at in row_chunks(rows, groups * MX_BLOCK_SIZE, x.device):
        values = _fake_quantize_blocks(to_blocks(flat[rows_at], groups, MX_BLOCK_SIZE), fmt, scale_rule)
        out[rows_at] = from_blocks(values, k)
    return out.reshape(x.shape)


def _dequantize_geometry(data: torch.Tensor, scale: torch.Tensor, fmt: ElemFormat, block_size: int):
    """Check ``data`` / ``scale`` of ``dequantize_mx``; returns ``(scale as uint8, K, groups)``."""
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        scale = scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise TypeError(f"dequantize_mx: scale must be uint8 E8M0 codes, got {scale.dtype}")
    want = torch.uint8 if fmt is FP4_E2M1 else torch.float8_e4m3fn
    if data.dtype != want:
        kind = "packed uint8" if fmt is FP4_E2M1 else "float8_e4m3fn"
        raise TypeError(f"dequantize_mx: {fmt.name} data must be {kind}, got {data.dtype}")
    k = data.shape[-1] * 2 if fmt is FP4_E2M1 else data.shape[-1]
    groups = spec.ceil_div(k, block_size)
    if tuple(scale.shape) != (*data.shape[:-1], groups):
        raise ValueError(
            f"dequantize_mx: scale shape {tuple(scale.shape)} does not match data shape {tuple(data.shape)}; "
            f"expected {(*data.shape[:-1], groups)} for K={k}, block_size={block_size}"
        )
    return scale, k, groups


def _output_tensor(
    out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device
) -> torch.Tensor:
    """``out`` after checking it is a contiguous ``dtype`` tensor of ``shape``, or a new one."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"dequantize_mx: out must be {dtype} {shape} on {device}, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    if not out.is_contiguous():
        raise ValueError("dequantize_mx: out must be contiguous")
    return out


def _element_values(d: torch.Tensor, fmt: ElemFormat, compute: torch.dtype) -> torch.Tensor:
    """Element values of data rows ``(n, K/2)`` packed FP4 or ``(n, K)`` FP8, as ``(n, K)`` ``compute``."""
    if fmt is not FP4_E2M1:
        return d.to(compute)
    # One gather of both values of a byte, read as a single 32/64-bit word.
    table = byte_to_pair_table(d.device, compute)
    words = table.view(torch.int32 if compute == torch.bfloat16 else torch.int64).reshape(256)
    return words.index_select(0, d.reshape(-1).to(torch.int32)).view(compute).reshape(d.shape[0], -1)


def _scale_rows(vals: torch.Tensor, s: torch.Tensor, out: torch.Tensor, block_size: int) -> None:
    """``out`` (n, K) = ``vals`` (n, K) x per-block scales ``s`` (n, groups), one rounding to out's dtype."""
    n, k = vals.shape
    groups = s.shape[-1]
    if groups * block_size != k:
        out[:] = from_blocks(to_blocks(vals, groups, block_size) * s.unsqueeze(-1), k)
    elif vals.dtype == out.dtype:
        torch.mul(vals.view(n, groups, block_size), s.unsqueeze(-1), out=out.view(n, groups, block_size))
    else:
        out[:] = (vals.view(n, groups, block_size) * s.unsqueeze(-1)).view(n, k)


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
    scale, k, groups = _dequantize_geometry(data, scale, fmt, block_size)
    result = _output_tensor(out, (*data.shape[:-1], k), dtype, data.device)
    rows = row_count(data)
    if rows == 0 or k == 0:
        return result
    flat_out = result.view(rows, k)
    flat_data = data.reshape(rows, data.shape[-1])
    flat_scale = scale.reshape(rows, groups)
    # E2M1 values have at most two significant bits and scales are powers of two, so a bf16
    # product equals the float32 product rounded once to bf16: compute bf16 output in bf16.
    compute = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    for rows_at in row_chunks(rows, groups * block_size, data.device):
        vals = _element_values(flat_data[rows_at], fmt, compute)
        _scale_rows(vals, e8m0_to_float(flat_scale[rows_at], compute), flat_out[rows_at], block_size)
    return result
