"""``mxfp4_dualscale``: the dual-level MXFP4 Linear method (per-32 E8M0 + per-512 FP32 + Smooth)."""

from __future__ import annotations

import torch
from torch.nn import Parameter

from ..config import Mxfp4DualScaleConfig
from ..formats import DUAL_BLOCK_SIZE
from .linear import MxLinearMethod
from .quant_config import Mxfp4DualScaleQuantizationConfig


class Mxfp4DualScaleLinearMethod(MxLinearMethod):
    """Dual-level MXFP4: offline checkpoints carry ``weight_dual_scale`` and a required ``mul_scale``."""

    dual_scale = True
    method_name = "mxfp4_dualscale"
    config: Mxfp4DualScaleConfig

    def _smooth_required(self) -> bool:
        return True

    def _extra_checkpoint_params(self, layer: torch.nn.Module, n: int, k: int) -> None:
        dual = torch.empty(n, -(-k // DUAL_BLOCK_SIZE), 1, dtype=torch.float32)
        self._register(
            layer,
            "weight_dual_scale",
            Parameter(dual, requires_grad=False),
            {"input_dim": 1, "output_dim": 0, "is_checkpoint_required": True},
            self._layer_loader,
        )


Mxfp4DualScaleQuantizationConfig.method_class = Mxfp4DualScaleLinearMethod
