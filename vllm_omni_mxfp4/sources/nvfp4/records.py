"""The typed description of an NVFP4 checkpoint, and the one error its readers raise.

Detection (:mod:`.detect`) turns a checkpoint into an :class:`Nvfp4Checkpoint`: one
:class:`LayerSource` per Linear-like module, saying what will happen to it and why, and where its
tensors are. The load-time integration and the convert CLI act on it without re-reading configs;
the same record is the per-layer report a user sees ("requantized / dequantized / kept").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

ACTIONS = ("requantize", "dequantize", "keep")
"""``requantize``: NVFP4 -> MXFP4. ``dequantize``: an FP8 layer of a mixed checkpoint, served in BF16
(FP8 precision or better). ``keep``: stored unquantized, served as stored."""

NIBBLE_ORDERS = ("low_even", "high_even")
"""Which nibble of a packed byte holds the even element (``low_even`` is the canonical order)."""

SCALE_LAYOUTS = ("linear", "swizzled")
"""``linear``: row-major ``(N, K/16)``. ``swizzled``: cuBLAS 2-D blocked, 128x4 tiles, padded."""


class SourceError(ValueError):
    """A layer (or config) we refuse: it names the layer, the reason, and how to proceed."""

    def __init__(self, layer: str, reason: str, fix: str = "") -> None:
        self.layer = layer
        self.reason = reason
        self.fix = fix
        super().__init__(f"{layer}: {reason}" + (f"; {fix}" if fix else ""))


@dataclass(frozen=True)
class LayerSource:
    """What happens to one module of the checkpoint, and where its tensors are.

    ``tensors`` maps roles to checkpoint keys: ``weight``, ``weight_scale``, ``global_scale``,
    optionally ``mul_scale`` (a foldable ``pre_quant_scale``) and ``bias``. For ``requantize``
    layers, ``shape`` is the stored ``(N, K)`` and ``nibble_order`` / ``scale_layout`` /
    ``global_divides`` say how :func:`~.layouts.load_nvfp4_weight` normalises them.
    """

    name: str
    action: str
    algo: str
    reason: str
    tensors: Mapping[str, str] = field(default_factory=dict)
    shape: tuple[int, int] | None = None
    nibble_order: str | None = None
    scale_layout: str | None = None
    global_divides: bool = False


@dataclass(frozen=True)
class Nvfp4Checkpoint:
    """Every described module of an NVFP4 checkpoint, by name, and who made it.

    ``producer``: ``modelopt``, ``compressed-tensors`` or ``comfy``; ``origin``: where NVFP4 was
    declared (a file and key), for messages.
    """

    producer: str
    origin: str
    layers: Mapping[str, LayerSource]

    def names(self, action: str) -> list[str]:
        """Sorted names of the layers whose action is ``action``."""
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {list(ACTIONS)}, got {action!r}")
        return sorted(name for name, layer in self.layers.items() if layer.action == action)

    def summary(self) -> str:
        """One line: the producer and how many layers each action has."""
        counts = ", ".join(f"{len(self.names(a))} {a}" for a in ACTIONS)
        return f"NVFP4 checkpoint by {self.producer} ({self.origin}): {counts}"
