"""Three ops that CUDA and Ascend provide and vLLM's CPU path lacks, as vLLM-Omni 0.30's models call them.

Installed only in processes where the CPU platform is active
(:func:`vllm_omni_mxfp4.platform.install_fixups`, before any model is built); both leave every
call that already works to upstream's own code.

1. **A strided input to an unquantized vLLM Linear, or one in the wrong dtype.** Upstream:
   ``vllm.model_executor.layers.utils.cpu_unquantized_gemm``, which every ``UnquantizedLinearMethod``
   binds on a CPU platform (``dispatch_unquantized_gemm``) and which calls the oneDNN or SGL kernel
   that ``dispatch_cpu_unquantized_gemm`` packed. Those kernels require a row-major input
   (``torch.ops._C.onednn_mm``: ``Expected a.stride(-1) == 1``); CUDA and Ascend run the same call
   through ``F.linear``, which takes any strides. Sana-WM's attention output gate
   (``SanaWmSelfAttention._apply_output_gate_and_proj``, ``self.proj(gated.to(...))``) hands its
   ``proj`` a transposed view. :func:`cpu_unquantized_gemm` makes such an input contiguous first.
   On CPUs with AMX tiles, vLLM packs small BF16/FP16 weights for SGL's ``weight_packed_linear``
   (``check_cpu_sgl_kernel``) and turns the layer's bias into FP32 while doing so. Models that read
   the compute dtype off a bias (Z-Image's and Ming's ``TimestepEmbedder``:
   ``self.mlp[0].bias.dtype``) then hand the kernel an FP32 input for a BF16 weight, which it
   refuses (``"weight_packed_linear_kernel_impl" not implemented for 'Float'``). On CUDA the bias
   keeps the weight's dtype and the model casts its input to it; :func:`cpu_unquantized_gemm` makes
   that cast for the layer whose bias the packing changed.
2. **Wan-style rotary embedding with a per-token table.** Upstream:
   ``vllm_omni.diffusion.layers.rope.RotaryEmbeddingWan.forward_native``, which is what vLLM-Omni's
   ``CustomOp`` dispatches to on an out-of-tree platform. It multiplies the (batch, tokens, heads,
   head_dim / 2) halves of the query by ``cos``/``sin`` as given, so a (tokens, head_dim / 2) table
   lines its tokens up with the heads axis. The CUDA path (``vllm.vllm_flash_attn`` rotary kernel)
   and the Ascend path (MindIE-SD) take that table as per-token, shared by every head, and
   LingBot-World (``CausalLingBotWorldTransformer3DModel._rotary_embedding``) builds exactly that
   table. :func:`wan_rope_native` inserts the heads axis for that layout and leaves every other
   layout (Wan2.2's tables already carry it) to upstream's method. Upstream's native method is also
   what CUDA without ``vllm.vllm_flash_attn``, XPU and Ascend without MindIE-SD run, so LingBot-World
   fails there the same way; this override covers the CPU platform only.
3. **Ring attention's per-chunk kernel.** Upstream: the module attribute
   ``vllm_omni.diffusion.attention.backends.ring.ring_kernels._scaled_dot_product_efficient_attention``
   (``torch.ops.aten._scaled_dot_product_efficient_attention``), which ``pytorch_attn_forward`` calls
   for every key/value chunk a ring step brings, whatever the attention backend (ring's runner
   picks the ``"efficient"`` SDPA op itself). PyTorch implements that op for CUDA only, so
   ``ring_degree > 1`` stopped at the first attention on the CPU. The ring merges chunks with the
   output and the natural-log ``logsumexp`` of shape (batch, heads, tokens); PyTorch's CPU flash
   kernel, ``aten::_scaled_dot_product_flash_attention_for_cpu``, returns exactly that pair.
   :func:`ring_chunk_attention` calls it for CPU tensors without an attention bias (the only call
   ring makes) and leaves every other call to upstream's op.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..patching import original_of, wrap_once

logger = logging.getLogger(__name__)

HOOK = "cpu_op_fixups"


def cpu_unquantized_gemm(
    layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """vLLM's CPU unquantized GEMM, taking an input of any strides as ``F.linear`` on CUDA does, and
    in the weight's dtype where vLLM's AMX packing made the bias FP32 (module docstring)."""
    if x.dim() > 0 and x.stride(-1) != 1:
        x = x.contiguous()
    params_dtype = getattr(layer, "params_dtype", None)
    if (
        params_dtype in (torch.bfloat16, torch.float16)
        and x.dtype == torch.float32
        and bias is not None
        and bias.dtype == torch.float32
    ):
        x = x.to(params_dtype)
    return layer.cpu_linear(x, weight, bias)


def wan_rope_native(self: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``RotaryEmbeddingWan.forward_native`` taking a per-token (tokens, head_dim / 2) table for a
    (batch, tokens, heads, head_dim) input, as the CUDA and Ascend kernels do."""
    upstream = upstream_wan_rope_native()
    if x.dim() == 4 and cos.dim() == 2 and sin.dim() == 2 and cos.shape[0] == x.shape[1]:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return upstream(self, x, cos, sin)


def ring_chunk_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | None = None,
    compute_log_sumexp: bool = True,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """``aten::_scaled_dot_product_efficient_attention`` as ring attention calls it, on the CPU:
    (output (B, H, S, D), natural-log logsumexp (B, H, S) in FP32) from PyTorch's CPU flash kernel."""
    if query.device.type != "cpu" or attn_bias is not None:
        return upstream_ring_chunk_attention()(
            query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, scale=scale
        )
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, scale=scale
    )[:2]
    return out, lse


def upstream_ring_chunk_attention() -> Callable[..., Any]:
    """The op the installed vLLM-Omni's ring kernels call, whether or not overridden."""
    from vllm_omni.diffusion.attention.backends.ring import ring_kernels

    return original_of(ring_kernels._scaled_dot_product_efficient_attention)


def upstream_cpu_unquantized_gemm() -> Callable[..., torch.Tensor]:
    """The installed vLLM's own ``cpu_unquantized_gemm``, whether or not overridden."""
    from vllm.model_executor.layers import utils

    return original_of(utils.cpu_unquantized_gemm)


def upstream_wan_rope_native() -> Callable[..., torch.Tensor]:
    """The installed vLLM-Omni's own ``RotaryEmbeddingWan.forward_native``, whether or not overridden."""
    from vllm_omni.diffusion.layers.rope import RotaryEmbeddingWan

    return original_of(RotaryEmbeddingWan.__dict__["forward_native"])


def install_op_fixups() -> list[str]:
    """Override the three upstream functions (module docstring); idempotent.

    Returns the names of those this call installed (empty when all were already in place).
    Layers built before the call keep the function they bound at construction.
    """
    from vllm.model_executor.layers import utils
    from vllm_omni.diffusion.attention.backends.ring import ring_kernels
    from vllm_omni.diffusion.layers.rope import RotaryEmbeddingWan

    installed = []
    # read by dispatch_unquantized_gemm at each Linear's construction
    if wrap_once(utils, "cpu_unquantized_gemm", lambda upstream: _calling(cpu_unquantized_gemm), HOOK):
        installed.append("vllm.model_executor.layers.utils.cpu_unquantized_gemm")
    # bound by CustomOp.dispatch_forward at construction
    if wrap_once(RotaryEmbeddingWan, "forward_native", lambda upstream: _calling(wan_rope_native), HOOK):
        installed.append("vllm_omni.diffusion.layers.rope.RotaryEmbeddingWan.forward_native")
    # looked up by pytorch_attn_forward at each call
    name = "_scaled_dot_product_efficient_attention"
    if wrap_once(ring_kernels, name, lambda upstream: _calling(ring_chunk_attention), HOOK):
        installed.append(f"vllm_omni.diffusion.attention.backends.ring.ring_kernels.{name}")
    for name in installed:
        logger.debug("CPU platform: %s overridden (vllm_omni_mxfp4.platform.op_fixups)", name)
    return installed


def _calling(function: Callable[..., Any]) -> Callable[..., Any]:
    """A new function that calls ``function`` (what :func:`~vllm_omni_mxfp4.patching.wrap_once`
    marks as the wrapper, leaving ``function`` itself unmarked)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return call
