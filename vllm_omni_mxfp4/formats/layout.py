"""The E8M0 scale layout the NPU kernels expect.

torch_npu stores the E8M0 scales of a row as pairs: ``(..., ceil(G/2), 2)`` uint8, zero-padded to an
even group count G (docs/kernels.md). Code 0 in the padding is harmless: it pairs with elements past
K, which the kernels treat as zero.
"""

from __future__ import annotations

import torch

from vllm_omni_mxfp4 import spec


def to_npu_scale_layout(scale: torch.Tensor) -> torch.Tensor:
    """(..., G) uint8 E8M0 codes -> (..., ceil(G/2), 2), zero-padding an odd G."""
    if scale.dtype != torch.uint8:
        raise TypeError(f"to_npu_scale_layout: expected uint8 E8M0 codes, got {scale.dtype}")
    groups = scale.shape[-1]
    if groups % 2:
        scale = torch.nn.functional.pad(scale, (0, 1))
    return scale.reshape(*scale.shape[:-1], scale.shape[-1] // 2, 2)


def from_npu_scale_layout(scale: torch.Tensor, groups: int) -> torch.Tensor:
    """(..., ceil(G/2), 2) -> (..., G): the inverse of :func:`to_npu_scale_layout`."""
    pairs = spec.ceil_div(groups, 2)
    if scale.shape[-1] != 2 or scale.shape[-2] != pairs:
        raise ValueError(
            f"from_npu_scale_layout: expected (..., {pairs}, 2) for {groups} groups, got {tuple(scale.shape)}"
        )
    return scale.reshape(*scale.shape[:-2], scale.shape[-2] * 2)[..., :groups]
