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

A backend that keeps its kernels' weight layout in the ``weight`` parameter's own storage (FRACTAL_NZ
on the NPU, AITER's preshuffled bytes on ROCm) saves a second copy of every weight; it registers a
conversion with :func:`adopt_weight_storage` so that ``state_dict()`` still returns the checkpoint
bytes; :func:`restore_checkpoint_weight`, which every backend's ``prepare`` calls first, undoes it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
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

    def check_supported(self, prefix: str, *, dual_scale: bool, scale_rule: str, w4a8: bool) -> None:
        """Raise ``NotImplementedError`` (naming the alternatives) for a layer this backend cannot run.

        Called by the Linear method when it is built, before any weight is allocated: ``dual_scale``
        for ``mxfp4_dualscale``, ``scale_rule`` the A4 activation rule ("floor" or "uos"), ``w4a8``
        when the layer may run W4A8 (by layer or on some denoising steps). Every layer is supported
        unless a backend says otherwise.
        """
        return None


def set_buffer(layer: torch.nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Register (or replace) a non-persistent buffer; ``None`` removes it."""
    if name in layer._buffers:
        del layer._buffers[name]
    if value is not None:
        layer.register_buffer(name, value, persistent=False)


def padded_weight(layer: torch.nn.Module, spec: MxLayerSpec) -> torch.Tensor:
    """The packed weight (N, K/2) with ``spec.k_pad_front`` / ``k_pad_back`` zero elements around K.

    Call after :func:`restore_checkpoint_weight`. A row-parallel shard stores only its own K range, while its scales cover every block it touches;
    zero bytes (E2M1 +0) line the bytes up with the scales.
    """
    weight = layer.weight.data
    front, back = spec.k_pad_front, spec.k_pad_back
    if tuple(weight.shape) != (spec.out_features, spec.in_features // 2):
        raise ValueError(
            f"{spec.prefix}.weight: expected packed FP4 (N, K/2) = {(spec.out_features, spec.in_features // 2)}, "
            f"got {tuple(weight.shape)}"
        )
    if front % 2 or back % 2:
        raise ValueError(f"{spec.prefix}: K padding must be even to keep bytes whole, got {front}+{back}")
    if not (front or back):
        return weight
    return torch.nn.functional.pad(weight, (front // 2, back // 2))


def restore_checkpoint_weight(layer: torch.nn.Module) -> None:
    """Undo :func:`adopt_weight_storage`: the ``weight`` parameter holds packed uint8 (N, K/2) again.

    Every backend calls this first in ``prepare``, so a layer can move between backends.
    """
    to_checkpoint = getattr(layer, "_mx_weight_to_checkpoint", None)
    if to_checkpoint is not None:
        layer.weight.data = to_checkpoint(layer.weight.data)
        layer._mx_weight_to_checkpoint = None


def adopt_weight_storage(
    layer: torch.nn.Module, device_weight: torch.Tensor, to_checkpoint: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Make the ``weight`` parameter hold ``device_weight`` (a kernel layout of the same shape).

    The packed checkpoint bytes are released instead of living next to their device-format copy.
    ``to_checkpoint`` maps the device form back to packed uint8 (N, K/2); ``state_dict()`` applies
    it, so the state dict keeps exactly the checkpoint tensors.
    """
    if tuple(device_weight.shape) != tuple(layer.weight.shape):
        raise ValueError(
            f"adopt_weight_storage: device weight {tuple(device_weight.shape)} does not have the weight's "
            f"shape {tuple(layer.weight.shape)}"
        )
    layer.weight.data = device_weight
    layer._mx_weight_to_checkpoint = to_checkpoint
    if getattr(layer, "_mx_weight_hook", None) is None:
        layer._mx_weight_hook = layer.register_state_dict_post_hook(_checkpoint_weight_hook)


def _checkpoint_weight_hook(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    to_checkpoint = getattr(module, "_mx_weight_to_checkpoint", None)
    key = prefix + "weight"
    if to_checkpoint is not None and key in state_dict:
        state_dict[key] = to_checkpoint(state_dict[key])


def check_aiter_supported(prefix: str, *, dual_scale: bool, scale_rule: str, w4a8: bool, who: str) -> None:
    """Refuse what AITER's MXFP4 kernels cannot run (ROCm, and the emulated backend mirroring it)."""
    refusal = aiter_refusal(prefix, dual_scale=dual_scale, scale_rule=scale_rule, w4a8=w4a8, who=who)
    if refusal is not None:
        raise refusal


def aiter_refusal(
    prefix: str, *, dual_scale: bool, scale_rule: str, w4a8: bool, who: str
) -> NotImplementedError | None:
    """The error for a layer AITER cannot run (naming the alternatives), or None."""
    where = f"{prefix}: " if prefix else ""
    alternatives = "Run it with backend 'emulated' (any device, the NPU numerics), or on an Ascend 950 NPU (backend 'npu')"
    if dual_scale:
        return NotImplementedError(
            f"{where}mxfp4_dualscale is not supported by {who}: AITER has no dual-level (per-512 FP32 + per-32 "
            f"E8M0) GEMM. {alternatives}, or use single-scale 'mxfp4'."
        )
    if scale_rule != "floor":
        return NotImplementedError(
            f"{where}mxfp4_scale_alg=2 (UOS activations, dst_type_max=7.25) is not supported by {who}: AITER's "
            f"per-1x32 quantizer has no UOS rule. {alternatives}, or use mxfp4_scale_alg=0."
        )
    if w4a8:
        return NotImplementedError(
            f"{where}W4A8 fallback (MXFP8 activations, w4a8_fallback_layers / w4a8_fallback_steps) is not "
            f"supported by {who}: AITER's gemm_a4w4 takes FP4 activations only. {alternatives}, or list the "
            "layer in ignored_layers (BF16) instead."
        )
    return None
