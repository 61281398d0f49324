"""BFL -> diffusers names for FLUX.2 checkpoints (the Comfy/BFL FLUX.2-dev NVFP4 files), failing closed.

The BFL files name modules as Black Forest Labs' reference code does (``double_blocks.N.img_attn.qkv``,
``single_blocks.N.linear1``, ``final_layer.linear``); diffusers and vLLM-Omni's FLUX.2 transformer
use diffusers names. The tables below are those of diffusers' own conversion
(``convert_flux2_transformer_checkpoint_to_diffusers`` in ``diffusers/loaders/single_file_utils.py``,
diffusers 0.40), module by module:

- the root renames (``img_in`` -> ``x_embedder``, ``time_in.in_layer`` ->
  ``time_guidance_embed.timestep_embedder.linear_1``, ``final_layer.linear`` -> ``proj_out``, ...);
- ``final_layer.adaLN_modulation.1`` -> ``norm_out.linear`` with its two row halves swapped (BFL
  stores (shift, scale), diffusers (scale, shift));
- double-stream blocks -> ``transformer_blocks.N``: the fused ``img_attn.qkv`` / ``txt_attn.qkv`` are
  split into three equal row chunks (``attn.to_q/to_k/to_v``, ``attn.add_q_proj/add_k_proj/add_v_proj``),
  which is what vLLM-Omni's loader expects: it stacks them again into its fused ``to_qkv`` /
  ``add_kv_proj`` (:data:`FLUX2_RUNTIME_FUSED`);
- single-stream blocks -> ``single_transformer_blocks.N``: ``linear1`` stays fused as
  ``attn.to_qkv_mlp_proj`` (diffusers and vLLM-Omni both keep it one Linear);
- a norm's ``scale`` parameter becomes ``weight``.

A name the tables do not hold is refused (:class:`~.records.SourceError`), never passed through:
a wrong name would load as a missing weight. Splitting or swapping rows of an NVFP4 weight is exact
(each output row keeps its codes, block scales and the tensor's global scale), so the renaming
happens on the canonical weight before requantization.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from .records import SourceError

COMFY_PREFIX = "model.diffusion_model."
"""The prefix ComfyUI's full-model files put before the transformer's own names."""

_ROOT = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
    "final_layer.linear": "proj_out",
}
_SWAPPED = {"final_layer.adaLN_modulation.1": "norm_out.linear"}
_DOUBLE = {
    "img_attn.norm.query_norm": "attn.norm_q",
    "img_attn.norm.key_norm": "attn.norm_k",
    "img_attn.proj": "attn.to_out.0",
    "img_mlp.0": "ff.linear_in",
    "img_mlp.2": "ff.linear_out",
    "txt_attn.norm.query_norm": "attn.norm_added_q",
    "txt_attn.norm.key_norm": "attn.norm_added_k",
    "txt_attn.proj": "attn.to_add_out",
    "txt_mlp.0": "ff_context.linear_in",
    "txt_mlp.2": "ff_context.linear_out",
}
_DOUBLE_QKV = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_SINGLE = {
    "linear1": "attn.to_qkv_mlp_proj",
    "linear2": "attn.to_out",
    "norm.query_norm": "attn.norm_q",
    "norm.key_norm": "attn.norm_k",
}
_BLOCK_RE = re.compile(r"(double_blocks|single_blocks)\.(0|[1-9][0-9]*)\.(.+)")

FLUX2_RUNTIME_FUSED = {
    "attn.to_q": "attn.to_qkv",
    "attn.to_k": "attn.to_qkv",
    "attn.to_v": "attn.to_qkv",
    "attn.add_q_proj": "attn.add_kv_proj",
    "attn.add_k_proj": "attn.add_kv_proj",
    "attn.add_v_proj": "attn.add_kv_proj",
}
"""diffusers FLUX.2 block Linears that vLLM-Omni's transformer fuses (its ``stacked_params_mapping``)."""

FLUX2_BLOCK_LINEARS = {
    "transformer_blocks": frozenset(
        {
            *(p for parts in _DOUBLE_QKV.values() for p in parts),
            *(v for k, v in _DOUBLE.items() if "norm" not in k),
        }
    ),
    "single_transformer_blocks": frozenset({_SINGLE["linear1"], _SINGLE["linear2"]}),
}
"""The block Linears of vLLM-Omni's FLUX.2 (diffusers names), its only quantizable ones: the
embedders, the modulations, ``norm_out.linear`` and ``proj_out`` are plain ``nn.Linear`` (BF16)."""
_DIFFUSERS_BLOCK_RE = re.compile(r"(transformer_blocks|single_transformer_blocks)\.(0|[1-9][0-9]*)\.(.+)")


@dataclass(frozen=True)
class Renamed:
    """One diffusers module made from a BFL module: its name and which rows of the source it takes.

    ``part`` of ``parts`` equal row chunks (Q, K, V of a fused ``qkv``), or all rows; with
    ``swap_halves`` the two row halves exchanged (the final AdaLN's shift/scale order).
    """

    name: str
    part: int = 0
    parts: int = 1
    swap_halves: bool = False


def strip_comfy_prefix(name: str) -> str:
    """``name`` without ComfyUI's ``model.diffusion_model.`` prefix (unchanged when it has none)."""
    return name[len(COMFY_PREFIX) :] if name.startswith(COMFY_PREFIX) else name


def is_bfl(names: Iterable[str]) -> bool:
    """Whether a checkpoint's tensor or module names are BFL FLUX.2 names (it has BFL blocks)."""
    return any(_BLOCK_RE.match(strip_comfy_prefix(n)) for n in names)


def _block(kind: str, index: str, within: str, name: str) -> tuple[Renamed, ...]:
    if kind == "double_blocks":
        if within in _DOUBLE_QKV:
            parts = _DOUBLE_QKV[within]
            return tuple(Renamed(f"transformer_blocks.{index}.{p}", i, 3) for i, p in enumerate(parts))
        if within in _DOUBLE:
            return (Renamed(f"transformer_blocks.{index}.{_DOUBLE[within]}"),)
    elif within in _SINGLE:
        return (Renamed(f"single_transformer_blocks.{index}.{_SINGLE[within]}"),)
    raise SourceError(name, f"unknown BFL FLUX.2 {kind} module {within!r}", "this is not a FLUX.2 checkpoint")


def bfl_module(name: str) -> tuple[Renamed, ...]:
    """The diffusers module(s) of BFL module ``name`` (a Comfy prefix is dropped first)."""
    bare = strip_comfy_prefix(name)
    match = _BLOCK_RE.fullmatch(bare)
    if match is not None:
        return _block(*match.groups(), name)
    if bare in _ROOT:
        return (Renamed(_ROOT[bare]),)
    if bare in _SWAPPED:
        return (Renamed(_SWAPPED[bare], swap_halves=True),)
    raise SourceError(name, "unknown BFL FLUX.2 module", "this is not a FLUX.2 checkpoint")


def bfl_param(param: str) -> str:
    """A BFL parameter name in diffusers: a norm's ``scale`` is its ``weight``; others unchanged."""
    return "weight" if param == "scale" else param


def flux2_runtime_name(layer: str) -> str:
    """vLLM-Omni's FLUX.2 runtime Linear path of a diffusers Linear path (fused Q/K/V joined)."""
    match = _DIFFUSERS_BLOCK_RE.fullmatch(layer)
    if match is None:
        return layer
    kind, index, within = match.groups()
    return f"{kind}.{index}.{FLUX2_RUNTIME_FUSED.get(within, within)}"


def flux2_quantizable(layer: str) -> bool:
    """Whether vLLM-Omni's FLUX.2 builds this diffusers module as a quantizable vLLM Linear."""
    match = _DIFFUSERS_BLOCK_RE.fullmatch(layer)
    return match is not None and match.group(3) in FLUX2_BLOCK_LINEARS[match.group(1)]
