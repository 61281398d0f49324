"""The emulated kernel mirroring the ROCm backend: AITER's MXFP4 numerics on any device, ``mxfp4``.

What :class:`~.rocm.AiterSingle` computes, from the formats core: online weights and A4
activations use the installed AITER's scale rule (``rule``: ``rceil``, ``aiter_legacy``, ``even``
or ``floor``; :meth:`AiterSingle.scale_rule` reports it) instead of the config's FLOOR, float32
inputs are rounded to bf16 (after Smooth), the GEMM output is bf16-rounded and the bias is added
after it in float32. UOS activations, W4A8 and DualScale are refused as the ROCm backend refuses
them. Selected by ``VLLM_OMNI_MXFP4_EMULATED_MIRROR=rocm:<rule>`` (``rocm`` alone: ``rceil``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import envs
from ..formats import fake_quantize_mx, quantize_mx
from .base import Call, MxLayerSpec
from .emulated import EmulatedKernel, aligned
from .rocm import AITER_ALTERNATIVES, AITER_REFUSALS

AITER_RULES = ("rceil", "aiter_legacy", "even", "floor")


class EmulatedAiterSingle(EmulatedKernel):
    """``mxfp4`` with the ROCm backend's numerics: AITER's rule, bf16 inputs, bf16 GEMM output, bias after."""

    format = "mxfp4"
    numerics = "rocm"
    a4_rules = ("floor",)
    refusals = AITER_REFUSALS
    alternatives = AITER_ALTERNATIVES
    half_input = "after_smooth"

    def __init__(
        self,
        *,
        rule: str | None = None,
        cache_dequantized: bool | None = None,
        compute_dtype: str | None = None,
    ) -> None:
        super().__init__(cache_dequantized=cache_dequantized, compute_dtype=compute_dtype)
        if rule is None:
            rule = envs.emulated_mirror().partition(":")[2] or "rceil"
        if rule not in AITER_RULES:
            choices = ", ".join(["'npu'", "'rocm'", *(f"'rocm:{r}'" for r in AITER_RULES)])
            raise ValueError(f"emulated mirror must be one of {choices}; got {'rocm:' + rule!r}")
        self.rule = rule

    @property
    def mirror(self) -> str:
        return f"rocm:{self.rule}"

    @property
    def who(self) -> str:
        return (
            f"the emulated backend mirroring ROCm (mirror={self.mirror!r}; use mirror='npu' for everything)"
        )

    def _quantize_weight(self, weight: torch.Tensor, spec: MxLayerSpec) -> dict[str, torch.Tensor]:
        if weight.dtype not in (torch.bfloat16, torch.float16):
            weight = weight.to(torch.bfloat16)  # AITER's quantizer takes bf16/fp16
        data, scale = quantize_mx(weight, elem="fp4", scale_rule=self.rule)
        return {"weight": data, "weight_scale": scale}

    def _matmul(self, x: torch.Tensor, call: Call) -> torch.Tensor:
        xq = aligned(call.spec, x, lambda xp: fake_quantize_mx(xp, elem="fp4", scale_rule=self.rule))
        weight = self._weight(call)
        compute = self._compute_dtype(x.dtype)
        out = F.linear(xq.to(compute), weight.to(compute)).to(torch.bfloat16)
        if call.bias is not None:
            out = out.float() + call.bias.float()
        return out
