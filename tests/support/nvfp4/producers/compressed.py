"""compressed-tensors NVFP4 layers and configs made by compressed-tensors itself, on the CPU.

Scales come from its own observers' helpers (``generate_gparam``, ``calculate_qparams``) and the
packing from ``NVFP4PackedCompressor.compress``: ``weight_packed`` (low nibble = even element),
E4M3 ``weight_scale`` and the global scale stored as a divisor, ``weight_global_scale``.
"""

from __future__ import annotations

import json
from typing import Any

import torch


def _scheme():
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4

    return QuantizationScheme(targets=["Linear"], **NVFP4)


def ct_layer(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The compressed state dict of one Linear weight ``(N, K)``."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = _scheme()
    n, k = weight.shape
    g = generate_gparam(weight.min(), weight.max())
    groups = weight.reshape(n, k // 16, 16)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=g)
    state = {"weight": weight, "weight_scale": scale, "weight_global_scale": g}
    return dict(NVFP4PackedCompressor.compress(state, scheme))


def ct_config(ignore: list[str]) -> dict[str, Any]:
    """compressed-tensors' own ``quantization_config`` for an NVFP4 packed checkpoint."""
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(
        config_groups={"group_0": _scheme()},
        format="nvfp4-pack-quantized",
        quantization_status="compressed",
        ignore=ignore,
    )
    return json.loads(json.dumps(config.to_dict(), default=str))
