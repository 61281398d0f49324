"""The vLLM-Omni transformers the convert writes for: which Linears they quantize, which they fuse.

An offline MXFP4 checkpoint must match what the runtime builds: a Linear that vLLM-Omni creates as
a plain ``nn.Linear`` (embedders, ``proj_out``, modulations) only takes a BF16 weight, and a fused
runtime Linear (Wan's ``attn1.to_qkv``, FLUX.2's ``attn.to_qkv`` / ``attn.add_kv_proj``) is all
MXFP4 or all BF16. ``ignored_layers`` holds runtime names.

Wan2.2 and FLUX.2 (whose Comfy/BFL files are renamed to diffusers names first) have the fixed
tables below, which need no vLLM-Omni at convert time (tests/convert/test_convert_models.py checks
them against the class). Every other class gets its answers from vLLM-Omni's class itself, as the
merge does (:func:`derived_target`: :func:`vllm_omni_mxfp4.models.derive_names` builds it on the
meta device and traces its ``load_weights``), and a tensor that class does not load is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni_mxfp4.errors import CheckpointError, read_json_object
from vllm_omni_mxfp4.models.names import names_of_class
from vllm_omni_mxfp4.models.wan import runtime_layer_name
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


def _pipeline_class(directory: Path) -> str | None:
    """The diffusers pipeline class of the pipeline holding component ``directory``, if any (it tells
    :func:`~vllm_omni_mxfp4.models.derive_names` which vLLM-Omni model folder to look in first)."""
    index = directory.absolute().parent / "model_index.json"
    if not index.is_file():
        return None
    name = read_json_object(index, if_missing="").get("_class_name")
    return name if isinstance(name, str) else None


def derived_target(
    directory: Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    provider: Callable[..., dict],
) -> TargetModel:
    """The target of ``config``'s ``_class_name`` from vLLM-Omni's class
    (:func:`~vllm_omni_mxfp4.models.names.names_of_class`, which refuses a tensor the class does
    not load)."""
    names = names_of_class(directory, config, tensors, provider, _pipeline_class(directory))
    return TargetModel(names.model_class, names.is_runtime_quantizable, names.runtime_layer_name)
