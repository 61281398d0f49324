"""``mxfp8``: the W8A8 MXFP8 Linear method of the layers a checkpoint lists in ``mxfp8_layers``.

msModelSlim's Wan2.2 recipes store blocks 0-4 as MXFP8 next to MXFP4 layers in the same
transformer; the checkpoint's ``quantization_config`` (method ``mxfp4`` or ``mxfp4_dualscale``)
names them in ``mxfp8_layers`` and routes them to :data:`~vllm_omni_mxfp4.config.Precision.W8A8`,
whatever its method. The layer's checkpoint tensors are :data:`vllm_omni_mxfp4.spec.FORMAT_TENSORS`'
``mxfp8`` entry (``weight`` float8_e4m3fn (N, K), ``weight_scale`` uint8 E8M0 (N, ceil(K/32)),
``bias``); activations are quantized to MXFP8 at run time with the OCP rule (the config's
``mxfp4_scale_alg`` is about FP4 activations and does not apply). Offline only: the config refuses
``mxfp8_layers`` in an online config. W4A8 fallback does not apply (the weights are 8-bit).
"""

from __future__ import annotations

from typing import Any

import torch

from ..formats import MXFP8_SCALE_RULE
from ..spec import CheckpointTensor
from .linear import MxLinearMethod
from .loading import check_values
from .state import MxLayerState


def checked_fp8_weight(where: str, record: CheckpointTensor, t: torch.Tensor, k_full: int) -> torch.Tensor:
    """An MXFP8 layer's checkpoint ``weight`` (any N: fused layers load theirs in pieces): a
    ``float8_e4m3fn`` (N, ``k_full``) tensor without NaN codes (``record``'s value rule)."""
    if t.dtype != torch.float8_e4m3fn or t.dim() != 2 or t.shape[-1] != k_full:
        if t.dtype == torch.uint8 and t.dim() == 2 and t.shape[-1] * 2 == k_full:
            found = ", the packed FP4 bytes of an MXFP4 layer"
        elif t.is_floating_point() and t.dtype != torch.float8_e4m3fn:
            found = ", an unquantized weight"
        else:
            found = ""
        raise ValueError(
            f"{where}: a layer listed in mxfp8_layers loads an MXFP8 weight, float8_e4m3fn (N, {k_full}); "
            f"the checkpoint holds {t.dtype} {tuple(t.shape)}{found}. The quantization_config's mxfp8_layers "
            "does not describe this checkpoint's tensors: correct it in the transformer's config.json, or "
            "merge the checkpoint again (vllm-omni-mxfp4 merge writes the tensors and the list together)."
        )
    codes = t.view(torch.uint8)
    # The rule marks NaN codes; on the magnitude bits the valid codes are one interval (one pass).
    check_values(where, record.value_rule, codes & 0x7F, original=codes)
    return t


class Mxfp8LinearMethod(MxLinearMethod):
    """MXFP8 W8A8: E4M3 weights and activations with one E8M0 scale per 32 inputs (offline only)."""

    method_name = "mxfp8"
    packed_fp4 = False  # one E4M3 element a byte: any K
    foreign_tensor_error = (
        "A layer listed in mxfp8_layers cannot load {where}: an MXFP8 W8A8 layer stores weight "
        "(float8_e4m3fn), weight_scale and bias only. The checkpoint stores this layer in another format: "
        "correct mxfp8_layers in the transformer's config.json, or merge the checkpoint again."
    )

    @property
    def act_scale_rule(self) -> str:
        """The OCP rule (``floor(log2 amax) - 8``), msModelSlim's and the NPU's ``scale_alg=0``."""
        return MXFP8_SCALE_RULE

    def _checked(self, state: MxLayerState, name: str, t: torch.Tensor, *shard: Any) -> torch.Tensor:
        if name != "weight":
            return super()._checked(state, name, t, *shard)
        return checked_fp8_weight(self.where(name, *shard), self.tensor(name), t, state.geometry.k_full)
