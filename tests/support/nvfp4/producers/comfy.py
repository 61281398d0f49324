"""Comfy-layout NVFP4 layers made by comfy-kitchen itself (``TensorCoreNVFP4Layout``), on the CPU.

comfy-kitchen packs the even element in the high nibble and stores 128x4-swizzled block scales;
the layer's keys and its ``.comfy_quant`` marker are named the way ComfyUI saves them.
"""

from __future__ import annotations

import json
from typing import Any

import torch


def marker_tensor(conf: dict[str, Any]) -> torch.Tensor:
    """A ``<layer>.comfy_quant`` marker: the JSON config as a uint8 tensor."""
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def comfy_layer(
    name: str, weight: torch.Tensor, conf: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """comfy-kitchen's NVFP4 tensors of ``weight`` under ``name``, plus its marker."""
    from comfy_kitchen.tensor.nvfp4 import TensorCoreNVFP4Layout

    qdata, params = TensorCoreNVFP4Layout.quantize(weight)
    stored = TensorCoreNVFP4Layout.state_dict_tensors(qdata, params)
    out = {f"{name}.weight{suffix}": t for suffix, t in stored.items()}
    out[f"{name}.comfy_quant"] = marker_tensor(conf or {"format": "nvfp4"})
    return out
