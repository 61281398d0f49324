"""``mxfp4``: the single-scale W4A4 MXFP4 Linear method (online or offline, OCP/UOS, W4A8 fallback)."""

from __future__ import annotations

from ..config import Mxfp4Config
from ..spec import MUL_SCALE, MUL_SCALE_REQUIRED, CheckpointTensor
from .linear import MxLinearMethod


class Mxfp4LinearMethod(MxLinearMethod):
    """Single-scale MXFP4: E2M1 weights with one E8M0 scale per 32 inputs, shared by A4 and A8."""

    method_name = "mxfp4"
    serialized_infix = "mxfp4_"
    foreign_tensor_error = (
        "Single-scale mxfp4 cannot load DualScale tensor {where}; changing quant_method does not convert a "
        "checkpoint."
    )
    config: Mxfp4Config

    @property
    def act_scale_rule(self) -> str:
        return self.config.scale_rule

    def checkpoint_tensors(self) -> tuple[CheckpointTensor, ...]:
        """The table's tensors; ``mul_scale`` required when the config sets ``require_smooth_scale``."""
        tensors = super().checkpoint_tensors()
        if not self.config.require_smooth_scale:
            return tensors
        return tuple(MUL_SCALE_REQUIRED if t is MUL_SCALE else t for t in tensors)
