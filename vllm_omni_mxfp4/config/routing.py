"""How one Linear layer runs: its :class:`Precision` and the :class:`LayerRoute` that decides it.

A config (:meth:`~.methods.MethodConfig.route`) routes every Linear once, when the model is built:
BF16 > W4A8 by layer > W4A8 by denoise step > W4A4. A route with W4A8 steps is decided again at
each call from the current denoise step (:mod:`vllm_omni_mxfp4.steps`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from vllm_omni_mxfp4.steps import current_denoise_step

from .keys import is_int, show_value


class Precision(str, Enum):
    """How a Linear layer runs: unquantized, MXFP4 weights with MXFP8 or MXFP4 activations, or
    MXFP8 weights and activations (a layer the checkpoint stores as MXFP8: ``mxfp8_layers``)."""

    BF16 = "bf16"
    W4A8 = "w4a8"
    W4A4 = "w4a4"
    W8A8 = "w8a8"


@dataclass(frozen=True)
class LayerRoute:
    """The precision decision for one Linear layer.

    ``precision`` is the static decision. A W4A4 layer with non-empty ``a8_steps`` runs W4A8 on those
    denoise steps, so it needs the current step at forward time.
    """

    precision: Precision
    a8_steps: tuple[int, ...] = ()
    reason: str = ""
    prefix: str = ""

    def precision_at(self, step: int | None) -> Precision:
        """The precision at denoise step ``step``: BF16 > W4A8 (layer) > W4A8 (step) > W4A4."""
        if self.precision is not Precision.W4A4 or not self.a8_steps:
            return self.precision
        if step is None:
            raise RuntimeError(
                f"Layer {self.prefix!r} has W4A8 fallback on denoise steps {list(self.a8_steps)} but no "
                "denoise step is published. Run it inside a vLLM-Omni pipeline that records "
                "ForwardContext.denoise_step_idx, or wrap the call in "
                "vllm_omni_mxfp4.steps.denoise_step(step)."
            )
        if not is_int(step):
            raise TypeError(f"The denoise step must be an integer or None, got {show_value(step)}.")
        return Precision.W4A8 if step in self.a8_steps else Precision.W4A4

    def precision_now(self) -> Precision:
        """The precision at the current denoise step; looks the step up only when it matters."""
        if self.precision is not Precision.W4A4 or not self.a8_steps:
            return self.precision
        return self.precision_at(current_denoise_step())
