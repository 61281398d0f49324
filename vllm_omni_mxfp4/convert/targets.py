"""The vLLM-Omni transformers the convert writes for: which Linears they quantize, which they fuse.

An offline MXFP4 checkpoint must match what the runtime builds: a Linear that vLLM-Omni creates as
a plain ``nn.Linear`` (embedders, ``proj_out``, modulations) only takes a BF16 weight, and a fused
runtime Linear (Wan's ``attn1.to_qkv``, FLUX.2's ``attn.to_qkv`` / ``attn.add_kv_proj``) is all
MXFP4 or all BF16. ``ignored_layers`` holds runtime names. The convert refuses a transformer class
it has no table for rather than guess.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vllm_omni_mxfp4.checkpoint.errors import CheckpointError
from vllm_omni_mxfp4.checkpoint.names import runtime_layer_name
from vllm_omni_mxfp4.sources.nvfp4.names import flux2_quantizable, flux2_runtime_name


def wan_quantizable(layer: str) -> bool:
    """Whether vLLM-Omni's Wan2.2 builds this diffusers module as a quantizable vLLM Linear: the
    block Linears only (the condition embedders and ``proj_out`` are plain ``nn.Linear``)."""
    if not layer.startswith("blocks."):
        return False
    try:
        runtime_layer_name(layer)
    except CheckpointError:  # a norm or another non-Linear module of a block
        return False
    return True


@dataclass(frozen=True)
class TargetModel:
    """A diffusers transformer class: its quantizable Linears and their runtime names."""

    class_name: str
    quantizable: Callable[[str], bool]
    runtime_name: Callable[[str], str]


TARGETS = {
    t.class_name: t
    for t in (
        TargetModel("WanTransformer3DModel", wan_quantizable, runtime_layer_name),
        TargetModel("Flux2Transformer2DModel", flux2_quantizable, flux2_runtime_name),
    )
}


def target_of(class_name: object, config_path: Path) -> TargetModel:
    """The target of a config's ``_class_name``; a :class:`CheckpointError` naming the file otherwise."""
    if class_name not in TARGETS:
        raise CheckpointError(
            f"{config_path}: _class_name {class_name!r} is not a transformer the convert knows "
            f"({', '.join(TARGETS)}); it cannot tell which Linears vLLM-Omni quantizes or fuses"
        )
    return TARGETS[class_name]
