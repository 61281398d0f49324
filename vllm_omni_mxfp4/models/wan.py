"""Wan2.2 tensor names: original Wan repo -> diffusers -> vLLM-Omni runtime, as one exact table.

msModelSlim quantizes the modules of the original Wan repository (``blocks.N.self_attn.q``), the
diffusers checkpoint names them differently (``blocks.N.attn1.to_q``), and vLLM-Omni's runtime fuses
some of them (``blocks.N.attn1.to_qkv``). The tables below are exact: a name that is not in them is an
error, never a guess. They hold the mapping of diffusers' Wan conversion
(``scripts/convert_wan_to_diffusers.py``): the attention and FFN renames, the norm2/norm3 swap
(the original block applies norm1, norm3, norm2; diffusers numbers them in order), ``modulation``
-> ``scale_shift_table``, ``head.head`` -> ``proj_out``, the condition embedders and the Wan2.1 I2V /
FLF2V image-embedding keys.

Smooth quantization wraps a Linear: msModelSlim saves ``<p>.linear.<tensor>`` and
``<p>.div.mul_scale``; :func:`strip_smooth_wrapper` turns them back into ``<p>.<tensor>`` and
``<p>.mul_scale``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_omni_mxfp4 import spec

from ..errors import CheckpointError

LINEAR = "linear"
NORM = "norm"
CONV = "conv"
PARAM = "param"

#: Tensors a Linear may carry in a merged checkpoint: those of any format's quantized Linear.
LINEAR_LEAVES = frozenset(
    {t.name for fmt in spec.FORMATS for t in spec.checkpoint_tensors(fmt)}
    | {spec.LOW_RANK_L1, spec.LOW_RANK_L2}
)
#: Tensors of the other modules.
PLAIN_LEAVES = frozenset({"weight", "bias"})

# Modules outside the blocks: original name -> (diffusers name, kind).
_ROOT_MODULES: dict[str, tuple[str, str]] = {
    "patch_embedding": ("patch_embedding", CONV),
    "text_embedding.0": ("condition_embedder.text_embedder.linear_1", LINEAR),
    "text_embedding.2": ("condition_embedder.text_embedder.linear_2", LINEAR),
    "time_embedding.0": ("condition_embedder.time_embedder.linear_1", LINEAR),
    "time_embedding.2": ("condition_embedder.time_embedder.linear_2", LINEAR),
    "time_projection.1": ("condition_embedder.time_proj", LINEAR),
    "head.head": ("proj_out", LINEAR),
    "img_emb.proj.0": ("condition_embedder.image_embedder.norm1", NORM),
    "img_emb.proj.1": ("condition_embedder.image_embedder.ff.net.0.proj", LINEAR),
    "img_emb.proj.3": ("condition_embedder.image_embedder.ff.net.2", LINEAR),
    "img_emb.proj.4": ("condition_embedder.image_embedder.norm2", NORM),
}

# Bare parameters outside the blocks.
_ROOT_PARAMS: dict[str, str] = {
    "head.modulation": "scale_shift_table",
    "img_emb.emb_pos": "condition_embedder.image_embedder.pos_embed",
}

# Modules inside ``blocks.N.``: original suffix -> (diffusers suffix, kind).
_BLOCK_MODULES: dict[str, tuple[str, str]] = {
    "self_attn.q": ("attn1.to_q", LINEAR),
    "self_attn.k": ("attn1.to_k", LINEAR),
    "self_attn.v": ("attn1.to_v", LINEAR),
    "self_attn.o": ("attn1.to_out.0", LINEAR),
    "self_attn.norm_q": ("attn1.norm_q", NORM),
    "self_attn.norm_k": ("attn1.norm_k", NORM),
    "cross_attn.q": ("attn2.to_q", LINEAR),
    "cross_attn.k": ("attn2.to_k", LINEAR),
    "cross_attn.v": ("attn2.to_v", LINEAR),
    "cross_attn.o": ("attn2.to_out.0", LINEAR),
    "cross_attn.norm_q": ("attn2.norm_q", NORM),
    "cross_attn.norm_k": ("attn2.norm_k", NORM),
    "cross_attn.k_img": ("attn2.add_k_proj", LINEAR),
    "cross_attn.v_img": ("attn2.add_v_proj", LINEAR),
    "cross_attn.norm_k_img": ("attn2.norm_added_k", NORM),
    "norm1": ("norm1", NORM),
    "norm2": ("norm3", NORM),
    "norm3": ("norm2", NORM),
    "ffn.0": ("ffn.net.0.proj", LINEAR),
    "ffn.2": ("ffn.net.2", LINEAR),
}

# Bare parameters inside ``blocks.N.``.
_BLOCK_PARAMS: dict[str, str] = {"modulation": "scale_shift_table"}

# diffusers block Linear suffix -> vLLM-Omni runtime suffix (only the ones that differ).
_RUNTIME_BLOCK_LINEARS: dict[str, str] = {
    "attn1.to_q": "attn1.to_qkv",
    "attn1.to_k": "attn1.to_qkv",
    "attn1.to_v": "attn1.to_qkv",
    "attn1.to_out.0": "attn1.to_out",
    "attn2.to_q": "attn2.to_q",
    "attn2.to_k": "attn2.to_k",
    "attn2.to_v": "attn2.to_v",
    "attn2.to_out.0": "attn2.to_out",
    "attn2.add_k_proj": "attn2.add_k_proj",
    "attn2.add_v_proj": "attn2.add_v_proj",
    "ffn.net.0.proj": "ffn.net_0.proj",
    "ffn.net.2": "ffn.net_2",
}

_BLOCK_RE = re.compile(r"blocks\.(0|[1-9][0-9]*)\.(.+)")

_INVERSE_ROOT_MODULES = {d: (o, k) for o, (d, k) in _ROOT_MODULES.items()}
_INVERSE_ROOT_PARAMS = {d: o for o, d in _ROOT_PARAMS.items()}
_INVERSE_BLOCK_MODULES = {d: (o, k) for o, (d, k) in _BLOCK_MODULES.items()}
_INVERSE_BLOCK_PARAMS = {d: o for o, d in _BLOCK_PARAMS.items()}


@dataclass(frozen=True)
class TensorName:
    """One tensor's place in the model.

    ``name`` is the full tensor name, ``layer`` the module path (``None`` for a bare parameter such
    as ``scale_shift_table``), ``leaf`` the parameter within the module (the whole name for a bare
    parameter), ``kind`` one of ``linear``, ``norm``, ``conv``, ``param``, and ``block`` the block
    index or ``None`` outside the blocks.
    """

    name: str
    layer: str | None
    leaf: str
    kind: str
    block: int | None


def _lookup(
    name: str,
    root_modules: dict[str, tuple[str, str]],
    root_params: dict[str, str],
    block_modules: dict[str, tuple[str, str]],
    block_params: dict[str, str],
    naming: str,
) -> TensorName:
    match = _BLOCK_RE.fullmatch(name)
    if match:
        block: int | None = int(match.group(1))
        prefix, rest = f"blocks.{block}.", match.group(2)
        modules, params = block_modules, block_params
    else:
        block, prefix, rest = None, "", name
        modules, params = root_modules, root_params
    if rest in params:
        target = prefix + params[rest]
        return TensorName(target, None, target, PARAM, block)
    module, _, leaf = rest.rpartition(".")
    if module in modules:
        target_module, kind = modules[module]
        allowed = LINEAR_LEAVES if kind == LINEAR else PLAIN_LEAVES
        if leaf in allowed:
            layer = prefix + target_module
            return TensorName(f"{layer}.{leaf}", layer, leaf, kind, block)
    raise CheckpointError(f"unknown {naming} tensor name {name!r}: it is not in the exact Wan2.2 name table")


def wan_to_diffusers(name: str) -> TensorName:
    """The diffusers name of an original Wan tensor name (Smooth wrappers already stripped)."""
    return _lookup(name, _ROOT_MODULES, _ROOT_PARAMS, _BLOCK_MODULES, _BLOCK_PARAMS, "original Wan")


def diffusers_to_wan(name: str) -> str:
    """The original Wan name of a diffusers tensor name; the inverse of :func:`wan_to_diffusers`."""
    return _lookup(
        name,
        _INVERSE_ROOT_MODULES,
        _INVERSE_ROOT_PARAMS,
        _INVERSE_BLOCK_MODULES,
        _INVERSE_BLOCK_PARAMS,
        "diffusers",
    ).name


def parse_diffusers(name: str) -> TensorName:
    """Where a diffusers tensor name sits in the model (layer, leaf, kind, block)."""
    original = diffusers_to_wan(name)
    return wan_to_diffusers(original)


_WRAPPED_LEAVES = ("weight_dual_scale", "weight_scale", "weight", "bias", spec.LOW_RANK_L1, spec.LOW_RANK_L2)


def strip_smooth_wrapper(name: str) -> tuple[str, bool]:
    """Undo msModelSlim's Smooth wrapper names; returns ``(name, was_wrapped)``.

    ``<p>.linear.weight|weight_scale|weight_dual_scale|bias|svd_lowrank_l1|svd_lowrank_l2`` -> ``<p>.<leaf>`` and
    ``<p>.div.mul_scale`` -> ``<p>.mul_scale``; any other name is returned unchanged.
    """
    if name.endswith(".div.mul_scale"):
        return name[: -len(".div.mul_scale")] + ".mul_scale", True
    for leaf in _WRAPPED_LEAVES:
        suffix = f".linear.{leaf}"
        if name.endswith(suffix):
            return name[: -len(suffix)] + f".{leaf}", True
    return name, False


def runtime_layer_name(layer: str) -> str:
    """The vLLM-Omni runtime module path of a diffusers Wan2.2 Linear path, for the engine's load-error
    messages and NVFP4 plans (:mod:`vllm_omni_mxfp4.hooks`); the merge takes runtime names from the
    model class instead (:class:`~.names.ModelNames`).

    Self-attention Q/K/V become ``attn1.to_qkv``, ``to_out.0`` becomes ``to_out`` and the FFN uses
    ``net_0`` / ``net_2``; Linears outside the blocks keep their diffusers path.
    """
    match = _BLOCK_RE.fullmatch(layer)
    if match is None:
        if layer not in _INVERSE_ROOT_MODULES or _INVERSE_ROOT_MODULES[layer][1] != LINEAR:
            raise CheckpointError(f"{layer!r} is not a Wan2.2 Linear")
        return layer
    suffix = match.group(2)
    if suffix not in _RUNTIME_BLOCK_LINEARS:
        raise CheckpointError(f"{layer!r} is not a Wan2.2 block Linear")
    return f"blocks.{match.group(1)}.{_RUNTIME_BLOCK_LINEARS[suffix]}"
