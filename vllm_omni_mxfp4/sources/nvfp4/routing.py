"""How a runtime Linear fed by an NVFP4 checkpoint runs: the one decision serving, ``convert`` and
``inspect`` share.

A runtime Linear is fed by one checkpoint layer, or by several that the model fuses (Wan's
``attn1.to_qkv`` from ``to_q``/``to_k``/``to_v``). It is served as MXFP4 only when the model builds
it with a quantization config (a vLLM Linear, not a plain ``nn.Linear``) and every one of its parts
is an NVFP4 layer (``requantize``); ``W4A16_NVFP4`` parts (16-bit activations in the producer's
recipe) make it W4A8. Otherwise it runs in BF16: a fused Linear runs in one precision, so one part
stored unquantized or as FP8 keeps the whole group in BF16, the group's NVFP4 parts dequantized
exactly. Each part then becomes (:func:`part_action`) MXFP4, a BF16 dequant, or the stored tensor
kept as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .records import LayerSource

W4A16_ALGO = "W4A16_NVFP4"
"""The weight-only NVFP4 algorithm: served as MXFP4 with 8-bit activations (W4A8), not 4."""


@dataclass(frozen=True)
class LinearDecision:
    """How one runtime Linear runs: ``mxfp4`` (every part requantized; ``w4a8`` for weight-only
    NVFP4) or ``bf16``, and why."""

    method: str
    precision: str
    reason: str

    @property
    def quantized(self) -> bool:
        return self.method == "mxfp4"


def decide_linear(
    parts: Sequence[LayerSource], quantizable: bool, model_class: str = "the model", runtime: str = ""
) -> LinearDecision:
    """The decision for the runtime Linear ``runtime`` fed by ``parts`` (its checkpoint layers, in
    any order); ``quantizable``: the model builds it with its quantization config."""
    if not parts:
        raise ValueError("a runtime Linear needs at least one checkpoint layer to decide on")
    parts = sorted(parts, key=lambda p: p.name)  # the same words whichever order a caller lists them in
    others = [p for p in parts if p.action != "requantize"]
    if others and len(others) < len(parts):
        nvfp4 = ", ".join(p.name for p in parts if p.action == "requantize")
        reason = (
            f"fused at runtime into {runtime or 'one Linear'} with {others[0].name} ({others[0].reason}); "
            f"a fused Linear runs in one precision, so its NVFP4 parts ({nvfp4}) are dequantized to BF16"
        )
        return LinearDecision("bf16", "bf16", reason)
    if others:
        return LinearDecision("bf16", "bf16", others[0].reason)
    if not quantizable:
        return LinearDecision("bf16", "bf16", f"NVFP4, but {model_class} runs it as a plain nn.Linear (BF16)")
    algo = parts[0].algo
    if any(p.algo == W4A16_ALGO for p in parts):
        return LinearDecision("mxfp4", "w4a8", f"{W4A16_ALGO} in the checkpoint: 8-bit activations, not 4")
    return LinearDecision("mxfp4", "w4a4", f"{algo} ({parts[0].reason}), requantized to MXFP4")


def part_action(part: LayerSource, decision: LinearDecision) -> str:
    """What one part becomes under its Linear's ``decision``: ``mxfp4`` (requantized), ``kept`` (a
    layer the producer stored unquantized, copied as stored) or ``bf16`` (dequantized)."""
    if decision.quantized:
        return "mxfp4"
    return "kept" if part.action == "keep" else "bf16"
