"""Row-wise processing shared by the quantizers: input checks, row chunks and block padding.

Every function of this package works along the last dimension, so a tensor ``(..., K)`` is handled as
``rows`` rows of ``K``. The rows are processed in chunks: on CPU, chunks of about 256K elements keep
every intermediate in cache (a tuning choice, not part of any format); on other devices the whole
tensor is one chunk. Blocks are formed by zero-padding a chunk to a whole number of blocks, the
way the kernels treat a partial last block.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""The input dtypes of the quantizers."""

CPU_CHUNK_ELEMENTS = 1 << 18
"""Elements per chunk on CPU: small enough for the intermediates of one chunk to stay in cache."""


def check_float_input(x: torch.Tensor, name: str) -> None:
    """Reject anything but a bf16 / fp16 / fp32 tensor with at least one dimension."""
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name}: expected a bfloat16, float16 or float32 tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name}: expected at least one dimension, got a scalar")


def row_count(x: torch.Tensor) -> int:
    """The number of rows of ``x`` along its last dimension (0 when that dimension is empty)."""
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def row_chunks(rows: int, row_elements: int, device: torch.device) -> Iterator[slice]:
    """Slices of consecutive rows to process at once, each row holding ``row_elements`` elements."""
    if device.type != "cpu":
        step = max(rows, 1)
    else:
        step = max(1, min(rows, CPU_CHUNK_ELEMENTS // max(row_elements, 1)))
    for start in range(0, rows, step):
        yield slice(start, start + step)


def to_blocks(x: torch.Tensor, groups: int, block: int) -> torch.Tensor:
    """``(..., K)`` zero-padded to ``groups * block`` along the last dim and viewed as ``(..., groups, block)``."""
    pad = groups * block - x.shape[-1]
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], groups, block)


def from_blocks(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of :func:`to_blocks`: ``(..., groups, block)`` -> ``(..., k)`` without the padding."""
    groups, block = blocks.shape[-2:]
    return blocks.reshape(*blocks.shape[:-2], groups * block)[..., :k]
