"""``mxfp4_dualscale``: the dual-level MXFP4 Linear method (per-32 E8M0 + per-512 FP32 + Smooth).

Its checkpoint tensors (``weight_dual_scale`` and ``mul_scale`` besides the single-scale ones) come
from :data:`vllm_omni_mxfp4.spec.FORMAT_TENSORS`; it has no W4A8 route. A layer without ``mul_scale``
(one msModelSlim did not smooth, as vLLM-Omni's merge script writes it) runs with identity Smooth,
which is what msModelSlim computed for it.
"""

from __future__ import annotations

from ..config import Mxfp4DualScaleConfig
from .linear import MxLinearMethod


class Mxfp4DualScaleLinearMethod(MxLinearMethod):
    """Dual-level MXFP4: offline checkpoints carry ``weight_dual_scale`` and, where smoothed, ``mul_scale``."""

    method_name = "mxfp4_dualscale"
    config: Mxfp4DualScaleConfig
