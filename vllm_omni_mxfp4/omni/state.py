"""All per-layer state of a quantized Linear: one :class:`MxLayerState` at ``layer._mx``.

A quantized Linear moves through explicit phases (:class:`Phase`)::

    CREATED --first loader call--> LOADING --+--(online) weight complete, quantized--> QUANTIZED --+
                                              +--(offline) checked after loading-----> LOADED ----+--> PREPARED

``PREPARED`` means the kernel's :class:`~vllm_omni_mxfp4.kernels.Prepared` module is the layer's
child ``_mx_prepared``; only then does the layer run. The kernel-ready tensors live in that module
(buffers, so ``module.to()`` moves them); everything else about the layer lives here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..kernels import MxKernel, MxLayerSpec
from ..spec import MX_BLOCK, CheckpointTensor

PREPARED_ATTR = "_mx_prepared"
"""The layer attribute (a child module) holding the kernel's prepared tensors."""


class Phase(enum.Enum):
    """Where a quantized Linear is in its life."""

    CREATED = "created"  # parameters registered, nothing loaded
    LOADING = "loading"  # some checkpoint elements arrived
    QUANTIZED = "quantized"  # online: the complete BF16 weight was quantized and dropped
    LOADED = "loaded"  # offline: every required tensor arrived and passed the checks
    PREPARED = "prepared"  # the kernel built its tensors; the layer runs


@dataclass(frozen=True)
class ShardGeometry:
    """Where this partition's K sits in the checkpoint's.

    A row-parallel shard owns K elements ``[k0, k0 + k)`` of the checkpoint's ``k_full``. When that
    range does not start or end on a scale-block boundary (DualScale: 512; single scale: 32), the
    shard keeps the scales of every block it touches and pads ``front`` / ``back`` zero elements
    around its K at run time so that blocks line up; its online weight is quantized over that
    block-aligned range, exactly as TP=1 quantizes those blocks.
    """

    k_full: int
    k: int
    k0: int = 0
    front: int = 0
    back: int = 0
    sharded: bool = False

    @property
    def k_padded(self) -> int:
        return self.front + self.k + self.back

    def k_range(self, tensor: CheckpointTensor | None) -> tuple[int, int]:
        """The checkpoint K elements ``[lo, hi)`` this shard loads of ``tensor``: per-element tensors
        (packed weight bytes, Smooth) its own range, per-block tensors (scales) and the online BF16
        weight (``None``) the block-aligned range."""
        if tensor is not None and tensor.k_per_index < MX_BLOCK:
            return self.k0, self.k0 + self.k
        return self.k0 - self.front, self.k0 + self.k + self.back

    def k_of(self, tensor: CheckpointTensor) -> int:
        """The K that ``tensor``'s shape is computed from for this partition."""
        lo, hi = self.k_range(tensor)
        return hi - lo


@dataclass(eq=False)
class MxLayerState:
    """One quantized Linear's lifecycle state (plain Python, not in the state dict)."""

    spec: MxLayerSpec
    geometry: ShardGeometry
    kernel: MxKernel
    handle: int
    online: bool
    phase: Phase = Phase.CREATED
    loaded: dict[str, int] = field(default_factory=dict)
    load_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    low_rank: int = 0  # svd_rank of the layer's online low-rank branch (omni.low_rank); 0: none
    bf16_weight: torch.Tensor | None = None
    """Online, with ``VLLM_OMNI_MXFP4_KEEP_BF16``: this partition's loaded BF16 weight ``(N, K)``, kept
    on the host after quantization, so that ``vllm-omni-mxfp4 tune`` can run the layer in BF16."""

    def loaded_count(self, name: str) -> int:
        """Elements of parameter ``name`` written so far."""
        return self.loaded.get(name, 0)
