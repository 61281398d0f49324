"""comfy-kitchen's 16-row padding stripped back to the model's N, against comfy-kitchen's own output.

comfy-kitchen pads a weight with zero rows to a multiple of 16 before quantizing it and stores the
padded tensors; its own dequantization returns the padded matrix. Stripping must give exactly its
first N rows, and padded rows that are not zeros must be refused (they would not be the model's).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.support.nvfp4.checkpoints import write_checkpoint
from tests.support.nvfp4.producers.comfy import comfy_layer
from vllm_omni_mxfp4.formats.nvfp4 import dequantize_nvfp4
from vllm_omni_mxfp4.sources.nvfp4 import SourceError, detect_nvfp4, load_nvfp4_weight

NAME = "blocks.0.ffn.net.2"


def padded_layer(tmp_path: Path, n: int = 72, change=None):
    """A comfy-kitchen NVFP4 layer of ``n`` rows (stored padded to 80), its layer record and tensors."""
    weight = (torch.randn(n, 64, generator=torch.Generator().manual_seed(5)) * 0.1).bfloat16()
    tensors = comfy_layer(NAME, weight)
    if change is not None:
        change(tensors)
    layer = detect_nvfp4(write_checkpoint(tmp_path / "ckpt", tensors)).layers[NAME]
    return layer, tensors, weight


def test_stripped_rows_equal_comfy_kitchens_own_dequant(tmp_path: Path) -> None:
    from comfy_kitchen.tensor.nvfp4 import TensorCoreNVFP4Layout

    layer, tensors, weight = padded_layer(tmp_path)
    assert layer.shape == (80, 64)  # comfy-kitchen stored the padded matrix
    stripped = load_nvfp4_weight(layer, tensors.__getitem__, shape=(72, 64))
    assert stripped.shape == (72, 64)
    qdata, params = TensorCoreNVFP4Layout.quantize(weight)
    theirs = TensorCoreNVFP4Layout.dequantize(qdata, dataclasses.replace(params, orig_dtype=torch.float32))
    assert theirs.shape == (80, 64)
    assert torch.equal(dequantize_nvfp4(stripped, order="scale_first"), theirs[:72])


def test_unpadded_shape_is_left_alone(tmp_path: Path) -> None:
    layer, tensors, _ = padded_layer(tmp_path, n=64)
    assert load_nvfp4_weight(layer, tensors.__getitem__, shape=(64, 64)).shape == (64, 64)


def test_a_non_zero_padded_row_is_refused_naming_the_layer(tmp_path: Path) -> None:
    def dirty(tensors):
        tensors[f"{NAME}.weight"][75, 3] = 0x21

    layer, tensors, _ = padded_layer(tmp_path, change=dirty)
    with pytest.raises(SourceError, match=rf"{NAME}: padded rows 72\.\.79 hold non-zero codes"):
        load_nvfp4_weight(layer, tensors.__getitem__, shape=(72, 64))


@pytest.mark.parametrize("shape", [(60, 64), (72, 48), (72, 56)])
def test_a_shape_that_is_not_the_padding_is_refused(tmp_path: Path, shape) -> None:
    layer, tensors, _ = padded_layer(tmp_path)
    with pytest.raises(SourceError, match=rf"{NAME}: stored shape \(80, 64\) is not the model's"):
        load_nvfp4_weight(layer, tensors.__getitem__, shape=shape)
