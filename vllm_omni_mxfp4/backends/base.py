"""The backend interface the Linear methods program against.

A quantized Linear keeps its checkpoint tensors as parameters under the checkpoint's names
(``weight`` packed uint8 (N, K/2), ``weight_scale`` uint8 (N, G), ``weight_dual_scale`` float32
(N, C, 1), ``mul_scale`` float32 (K,)). A backend turns them into whatever its kernels consume,
stored on the layer as *non-persistent* buffers (so ``state_dict()`` stays the checkpoint and
``module.to()`` moves them), and runs the forward:

- :meth:`MxBackend.quantize_weight` / :meth:`MxBackend.quantize_weight_dualscale`: online weight
  quantization, once at load;
- :meth:`MxBackend.prepare`: after loading, build kernel-ready tensors;
- :meth:`MxBackend.linear`: ``y = x W^T + b`` for a 2-D activation, in the caller's dtype.

Three implementations: ``emulated`` (the formats core on any device), ``npu`` (torch_npu) and
``rocm`` (AITER). :func:`vllm_omni_mxfp4.backends.get_backend` picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MxLayerSpec:
    """What a backend needs to know about one quantized Linear partition."""

    prefix: str
    dual_scale: bool
    act_scale_rule: str  # A4 activation rule: "floor" (OCP) or "uos" (single scale); "floor" for dual
    in_features: int  # K of this partition
    out_features: int  # N of this partition
    has_smooth: bool  # a non-trivial Smooth multiplier (layer buffer ``_mx_smooth``) precedes quantization
    # A row-parallel shard whose K range does not start/end on a scale-block boundary (DualScale
    # with K/TP not a multiple of 512): its checkpoint tensors cover the whole blocks it touches,
    # and the backend pads weights and activations with this many zero elements before/after K so
    # that blocks line up with the checkpoint's. Zero otherwise.
    k_pad_front: int = 0
    k_pad_back: int = 0


class MxBackend(ABC):
    """One way of running MXFP4 Linears (emulated, NPU, ROCm)."""

    name: str = "base"

    @abstractmethod
    def quantize_weight(self, weight: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Online single-scale weight quantization: (N, K) -> packed uint8 (N, K/2), uint8 (N, G)."""

    @abstractmethod
    def quantize_weight_dualscale(
        self, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Online dual-scale weight quantization: packed (N, K/2), uint8 (N, G), float32 (N, C)."""

    @abstractmethod
    def prepare(self, layer: torch.nn.Module, spec: MxLayerSpec) -> None:
        """Build the kernel-ready form of the layer's checkpoint tensors (non-persistent buffers)."""

    @abstractmethod
    def linear(
        self,
        layer: torch.nn.Module,
        spec: MxLayerSpec,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        a8: bool,
    ) -> torch.Tensor:
        """``x`` (M, K) -> (M, N) in ``x``'s dtype; ``a8`` selects W4A8 (single scale only)."""

    def describe(self) -> str:
        """One line for logs: which backend and its options."""
        return self.name


def set_buffer(layer: torch.nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Register (or replace) a non-persistent buffer; ``None`` removes it."""
    if name in layer._buffers:
        del layer._buffers[name]
    if value is not None:
        layer.register_buffer(name, value, persistent=False)
