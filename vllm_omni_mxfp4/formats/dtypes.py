"""safetensors dtype names and torch dtypes: the one table between a file's header and a tensor."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    **({"F8_E8M0": torch.float8_e8m0fnu} if hasattr(torch, "float8_e8m0fnu") else {}),
}
"""The torch dtype of each safetensors dtype name (what a loaded tensor of that header entry has)."""

_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def safetensors_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.uint8`` -> ``U8``), or its torch name for one
    safetensors has none for (messages still name it)."""
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))
