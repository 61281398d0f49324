"""Write small checkpoint directories for the detection tests: tensors, configs, header metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from vllm_omni_mxfp4.sources.nvfp4 import TensorInfo

SAFETENSORS_DTYPES = {
    torch.uint8: "U8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
}


def tensor_info(t: torch.Tensor) -> TensorInfo:
    """The header description of a tensor, as safetensors writes it."""
    return TensorInfo(SAFETENSORS_DTYPES[t.dtype], tuple(t.shape))


def write_checkpoint(
    path: Path,
    tensors: dict[str, torch.Tensor],
    quantization_config: dict[str, Any] | None = None,
    metadata: dict[str, str] | None = None,
    hf_quant_config: dict[str, Any] | None = None,
) -> Path:
    """A diffusers-like component directory: one safetensors file, config.json, optional nested config."""
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata)
    config: dict[str, Any] = {"_class_name": "WanTransformer3DModel"}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, default=str))
    if hf_quant_config is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(hf_quant_config))
    return path
