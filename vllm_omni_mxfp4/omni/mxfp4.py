"""``mxfp4``: the single-scale W4A4 MXFP4 Linear method (online or offline, OCP/UOS, W4A8 fallback)."""

from __future__ import annotations

import torch
from torch.nn import Parameter

from ..config import Mxfp4Config
from .linear import MxLinearMethod
from .quant_config import Mxfp4QuantizationConfig


class Mxfp4LinearMethod(MxLinearMethod):
    """Single-scale MXFP4: E2M1 weights with one E8M0 scale per 32 inputs, shared by A4 and A8."""

    dual_scale = False
    method_name = "mxfp4"
    config: Mxfp4Config

    @property
    def weight_scale_rule(self) -> str:
        return self.config.scale_rule

    @property
    def act_scale_rule(self) -> str:
        return self.config.scale_rule

    def _smooth_required(self) -> bool:
        return self.config.require_smooth_scale

    def _extra_checkpoint_params(self, layer: torch.nn.Module, n: int, k: int) -> None:
        # A placeholder whose only job is to refuse DualScale tensors with a clear message; it is
        # removed after loading.
        sentinel = Parameter(torch.empty(0), requires_grad=False)
        layer.register_parameter("weight_dual_scale", sentinel)
        sentinel.is_checkpoint_optional = True
        sentinel.ignore_warning = True
        prefix = self.prefix

        def refuse(param, loaded_weight, *args) -> None:
            raise ValueError(
                f"Single-scale mxfp4 cannot load DualScale tensor {prefix}.weight_dual_scale; "
                "changing quant_method does not convert a checkpoint."
            )

        sentinel.weight_loader = refuse

    def _drop_unused_params(self, layer: torch.nn.Module) -> None:
        layer._parameters.pop("weight_dual_scale", None)


Mxfp4QuantizationConfig.method_class = Mxfp4LinearMethod
