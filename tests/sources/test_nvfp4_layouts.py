"""Producer layouts: un-swizzling against comfy-kitchen's own blocked layout, nibble swaps, fused rows."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.support.nvfp4.checkpoints import MODELOPT_FIXTURES
from vllm_omni_mxfp4.formats.nvfp4 import Nvfp4Weight, dequantize_nvfp4
from vllm_omni_mxfp4.sources.nvfp4 import (
    SourceError,
    detect_nvfp4,
    fuse_rows,
    load_nvfp4_weight,
    swap_nibbles,
    unswizzle_scales,
)

FIXTURES = MODELOPT_FIXTURES


@pytest.mark.parametrize("rows, cols", [(128, 4), (200, 7), (64, 20), (1, 1), (384, 12)])
def test_unswizzle_inverts_comfy_kitchens_blocked_layout(rows: int, cols: int) -> None:
    float_utils = pytest.importorskip("comfy_kitchen.float_utils")
    scales = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)
    blocked = float_utils.to_blocked(scales, flatten=False)
    assert torch.equal(unswizzle_scales(blocked, rows, cols), scales)
    assert torch.equal(unswizzle_scales(blocked.flatten(), rows, cols), scales)


def test_unswizzle_refuses_a_tensor_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match=r"not the blocked layout of a \(200, 7\)"):
        unswizzle_scales(torch.zeros(200, 7), 200, 7)


def test_swap_nibbles_is_its_own_inverse_and_swaps() -> None:
    packed = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(swap_nibbles(swap_nibbles(packed)), packed)
    assert int(swap_nibbles(torch.tensor([0x2A], dtype=torch.uint8))) == 0xA2


def q_k_v() -> list[Nvfp4Weight]:
    """ModelOpt's fused Q/K/V of the fixture, which share one weight_scale_2 after its fusion step."""
    checkpoint = detect_nvfp4(FIXTURES / "nvfp4")
    tensors = load_file(FIXTURES / "nvfp4" / "diffusion_pytorch_model.safetensors")
    return [
        load_nvfp4_weight(checkpoint.layers[f"blocks.0.attn1.to_{p}"], tensors.__getitem__) for p in "qkv"
    ]


def test_fused_parts_with_one_global_scale_stay_scalar() -> None:
    parts = q_k_v()
    fused = fuse_rows(parts, "blocks.0.attn1.to_qkv")
    assert fused.global_scale.dim() == 0 and fused.shape == (192, 64)
    assert torch.equal(dequantize_nvfp4(fused), torch.cat([dequantize_nvfp4(p) for p in parts]))


def test_fused_parts_with_different_global_scales_get_one_per_row() -> None:
    q, k, v = q_k_v()
    k = Nvfp4Weight(k.codes, k.scales, k.global_scale * 3, name=k.name)
    fused = fuse_rows([q, k, v], "blocks.0.attn1.to_qkv")
    assert fused.global_scale.shape == (192,)
    assert torch.equal(dequantize_nvfp4(fused), torch.cat([dequantize_nvfp4(p) for p in (q, k, v)]))


def test_fusing_parts_of_different_width_is_refused() -> None:
    q, _, _ = q_k_v()
    narrow = Nvfp4Weight(q.codes[:, :16], q.scales[:, :2], q.global_scale)
    with pytest.raises(SourceError, match=r"to_qkv: cannot fuse parts with K \[32, 64\]"):
        fuse_rows([q, narrow], "blocks.0.attn1.to_qkv")
