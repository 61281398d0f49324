"""Diffusion attention on the CPU platform: vLLM-Omni's torch-SDPA backend, dispatched for CPU.

vLLM-Omni's ``AttentionImpl.forward`` dispatches to ``forward_cuda`` / ``forward_hip`` /
``forward_npu`` / ``forward_xpu`` / ``forward_musa`` by platform and raises ``NotImplementedError``
for any other platform, out-of-tree ones included. The SDPA implementation itself
(``SDPAImpl._forward_impl``: mask reshaping, GQA handling, ``scaled_dot_product_attention``) is
device-agnostic, so the CPU backend only overrides the dispatch.
"""

from __future__ import annotations

import torch
from vllm_omni.diffusion.attention.backends.abstract import AttentionMetadata
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl


class CpuSDPAImpl(SDPAImpl):
    """``SDPAImpl`` whose ``forward`` runs on the CPU platform, with the CUDA-style broadcast mask."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")


class CpuSDPABackend(SDPABackend):
    """vLLM-Omni's ``TORCH_SDPA`` backend with :class:`CpuSDPAImpl` as its implementation."""

    @staticmethod
    def get_impl_cls() -> type[CpuSDPAImpl]:
        return CpuSDPAImpl
