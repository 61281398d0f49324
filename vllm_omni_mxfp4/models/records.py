"""What a model build finds, as plain data (no torch): the runtime Linears and where the model's
loader puts each checkpoint tensor. :mod:`.build` fills them from vLLM-Omni's class;
:mod:`vllm_omni_mxfp4.inspection` reads them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: vLLM fused-piece ids of Q/K/V (``QKVParallelLinear``); merged columns use integer ids.
QKV_SHARDS = ("q", "k", "v")


def piece_index(shard: Any) -> int:
    """The order of fused piece ``shard`` in its Linear: ``"q"``, ``"k"``, ``"v"`` or a column index."""
    return QKV_SHARDS.index(shard) if shard in QKV_SHARDS else int(shard)


@dataclass(frozen=True)
class RuntimeLinear:
    """One Linear of the built model: how it runs and its geometry.

    ``kind``: ``vllm`` (a vLLM ``LinearBase``, quantizable) or ``plain`` (``nn.Linear``: BF16 always).
    ``method``: our format (``mxfp4`` / ``mxfp4_dualscale``) or ``bf16``; ``precision`` its
    :class:`~vllm_omni_mxfp4.config.Precision` value; ``reason`` why. ``out_sizes`` the rows of each
    fused piece (one entry when not fused), ``in_features`` K; ``has_bias`` whether it loads a bias.
    """

    name: str
    kind: str
    method: str
    precision: str
    reason: str
    in_features: int
    out_sizes: tuple[int, ...]
    has_bias: bool = False
    a8_steps: tuple[int, ...] = ()

    @property
    def fused(self) -> bool:
        return len(self.out_sizes) > 1

    def piece(self, shard: Any) -> int | None:
        """The index of fused piece ``shard`` (``"q"``, ``1``...), ``None`` for the whole layer."""
        return None if shard is None else piece_index(shard)


@dataclass(frozen=True)
class Placement:
    """Where the model's loader put one checkpoint tensor: parameter, fused piece, or its refusal."""

    param: str | None = None
    shard: Any = None
    error: str | None = None


@dataclass
class ModelWalk:
    """What :func:`walk_model` learned: the class, its Linears and the checkpoint's placements."""

    class_name: str
    module: str
    linears: list[RuntimeLinear]
    placements: dict[str, Placement] = field(default_factory=dict)
    packed: dict[str, list[str]] = field(default_factory=dict)
    #: The modules that are no Linear and hold none (norms, embeddings...), by name: class name.
    modules: dict[str, str] = field(default_factory=dict)
