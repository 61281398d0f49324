"""Wan2.2 tensor names: original Wan repo -> diffusers -> vLLM-Omni runtime.

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

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni_mxfp4 import spec
from vllm_omni_mxfp4.config.keys import layer_order

from .errors import CheckpointError

LINEAR = "linear"
NORM = "norm"
CONV = "conv"
PARAM = "param"

#: Tensors a Linear may carry in a merged checkpoint: those of any format's quantized Linear.
LINEAR_LEAVES = frozenset(t.name for fmt in spec.FORMATS for t in spec.checkpoint_tensors(fmt))
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


_WRAPPED_LEAVES = ("weight_dual_scale", "weight_scale", "weight", "bias")


def strip_smooth_wrapper(name: str) -> tuple[str, bool]:
    """Undo msModelSlim's Smooth wrapper names; returns ``(name, was_wrapped)``.

    ``<p>.linear.weight|weight_scale|weight_dual_scale|bias`` -> ``<p>.<leaf>`` and
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
    messages (:mod:`vllm_omni_mxfp4.omni.loading`); the merge takes runtime names from the model
    class instead (:class:`ModelNames`).

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


natural_key = layer_order
"""Sort key that orders ``blocks.2`` before ``blocks.10``: the configs' own order of layer names, so
that a merged ``ignored_layers`` list and the tensors are written in the order the configs keep."""


#: How an export names its tensors: the original Wan repository's modules (msModelSlim's Wan
#: adapters quantize the Wan code's model; :func:`wan_to_diffusers` maps them) or the diffusers
#: checkpoint's (adapters that quantize a diffusers model, such as Qwen-Image-Edit's).
WAN_EXPORT_NAMES = "wan"
DIFFUSERS_EXPORT_NAMES = "diffusers"
EXPORT_NAMINGS = (WAN_EXPORT_NAMES, DIFFUSERS_EXPORT_NAMES)
#: A module that is not a Linear, in a model whose names come from the class (no norm/conv split).
MODULE = "module"
#: vLLM's ids of the fused Q/K/V pieces; merged columns use integer ids.
_QKV_SHARDS = ("q", "k", "v")
_ANY_BLOCK_RE = re.compile(r"^(?:[A-Za-z0-9_]*blocks)\.(0|[1-9][0-9]*)\.")


def _shard_order(shard: object) -> int:
    return _QKV_SHARDS.index(shard) if shard in _QKV_SHARDS else int(shard)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ModelNames:
    """One transformer's names: export -> diffusers, and diffusers -> vLLM-Omni runtime.

    ``export_names`` says how the export names tensors (:data:`EXPORT_NAMINGS`). ``tensors`` and
    ``linears`` are the plain data :func:`vllm_omni_mxfp4.models.derive_names` derives from the
    model class (its ``load_weights``, ``packed_modules_mapping`` and name rewrites): where each
    original tensor lands at runtime, and each runtime Linear's kind, quantizability and
    quantization prefix. Nothing here knows a model: a name the data lacks is an error.
    """

    model_class: str
    export_names: str
    tensors: dict[str, dict]
    linears: dict[str, dict]

    @classmethod
    def from_dict(cls, data: dict, export_names: str) -> ModelNames:
        """Read :func:`~vllm_omni_mxfp4.models.derive_names`'s data (checked, never trusted)."""
        if export_names not in EXPORT_NAMINGS:
            raise CheckpointError(
                f"export naming {export_names!r}; expected one of {', '.join(EXPORT_NAMINGS)}"
            )
        problems = [key for key in ("model_class", "tensors", "linears") if key not in data]
        if problems or not isinstance(data.get("tensors"), dict) or not isinstance(data.get("linears"), dict):
            raise CheckpointError(
                f"model name data lacks {problems or 'dict tensors/linears'}; it must come from "
                "vllm_omni_mxfp4.models.derive_names"
            )
        return cls(str(data["model_class"]), export_names, dict(data["tensors"]), dict(data["linears"]))

    def runtime_module(self, layer: str) -> str | None:
        """The runtime module the model loads diffusers module ``layer``'s weight into (None: none)."""
        placed = self.tensors.get(f"{layer}.weight") or {}
        param = placed.get("param")
        return None if param is None else param.rpartition(".")[0]

    def _linear(self, layer: str) -> dict | None:
        module = self.runtime_module(layer)
        return None if module is None else self.linears.get(module)

    def is_linear(self, layer: str) -> bool:
        """Whether diffusers module ``layer`` is loaded into a Linear of the model."""
        return self._linear(layer) is not None

    def check_loaded(self, name: str, where: str) -> None:
        """Refuse an original tensor the model's ``load_weights`` skips (the engine would drop it
        silently) or refuses; ``where`` names the file."""
        placed = self.tensors.get(name)
        if placed is None:
            raise CheckpointError(
                f"{where}: original tensor {name!r} is not loaded by vLLM-Omni's {self.model_class} "
                "(its load_weights skips the name); the original must be this class's diffusers checkpoint"
            )
        if "error" in placed:
            raise CheckpointError(
                f"{where}: vLLM-Omni's {self.model_class} refuses original tensor {name!r}: {placed['error']}"
            )

    def parse_diffusers(self, name: str) -> TensorName:
        """Where a diffusers tensor sits: its Linear (scales included), other module, or bare parameter."""
        if self.export_names == WAN_EXPORT_NAMES:
            return parse_diffusers(name)
        layer, _, leaf = name.rpartition(".")
        match = _ANY_BLOCK_RE.match(name)
        block = int(match.group(1)) if match else None
        if layer and self.is_linear(layer) and leaf in LINEAR_LEAVES:
            return TensorName(name, layer, leaf, LINEAR, block)
        if name not in self.tensors:
            raise CheckpointError(
                f"unknown tensor name {name!r}: vLLM-Omni's {self.model_class} does not load it"
            )
        if layer and leaf in PLAIN_LEAVES:
            return TensorName(name, layer, leaf, MODULE, block)
        return TensorName(name, None, name, PARAM, block)

    def export_to_diffusers(self, name: str) -> TensorName:
        """The diffusers place of an export tensor name (Smooth wrappers already stripped)."""
        if self.export_names == WAN_EXPORT_NAMES:
            return wan_to_diffusers(name)
        return self.parse_diffusers(name)

    def diffusers_to_export(self, name: str) -> str:
        """The export's name of a diffusers tensor name."""
        return diffusers_to_wan(name) if self.export_names == WAN_EXPORT_NAMES else name

    def runtime_layer_name(self, layer: str) -> str:
        """The name ``ignored_layers`` uses for diffusers Linear ``layer``: the prefix the model hands
        its quantization config (a fused layer's, for each of its pieces), or the module path of a
        Linear the model builds without one."""
        linear = self._linear(layer)
        if linear is None:
            raise CheckpointError(f"{layer!r} is not a Linear of vLLM-Omni's {self.model_class}")
        return linear["prefix"] if linear["quantizable"] else self.runtime_module(layer)

    def is_runtime_quantizable(self, layer: str) -> bool:
        """Whether the model builds diffusers Linear ``layer`` with its quantization config (the
        others run in BF16 whatever a checkpoint holds)."""
        linear = self._linear(layer)
        return linear is not None and bool(linear["quantizable"])

    def fused_piece(self, layer: str) -> tuple[str, int] | None:
        """``(runtime name, piece order)`` when the model fuses diffusers Linear ``layer`` with others
        into one runtime Linear (its ``packed_modules_mapping``), else ``None``."""
        placed = self.tensors.get(f"{layer}.weight") or {}
        if placed.get("shard") is None or not self.is_linear(layer):
            return None
        return self.runtime_layer_name(layer), _shard_order(placed["shard"])

    def strip_smooth_wrapper(self, name: str) -> tuple[str, bool]:
        """:func:`strip_smooth_wrapper`, except for a name that is already one of the model's (Qwen-Image's
        ``norm_out.linear.bias`` is a module called ``linear``, not a Smooth wrapper)."""
        stripped, wrapped = strip_smooth_wrapper(name)
        if wrapped:
            try:
                self.export_to_diffusers(name)
            except CheckpointError:
                return stripped, wrapped
            return name, False
        return stripped, wrapped

    def linear_layers(self) -> list[str]:
        """The diffusers paths of every Linear the model loads, in natural order."""
        layers = {name[: -len(".weight")] for name in self.tensors if name.endswith(".weight")}
        return sorted((layer for layer in layers if self.is_linear(layer)), key=layer_order)

    def attention(self, owner: str) -> tuple[str, list[str]]:
        """The attention an msModelSlim record on export module ``owner`` belongs to (``q_rot`` /
        ``k_rot``, FA3 ``quant_type``; Wan hangs them on ``blocks.N.self_attn``, Qwen-Image on the
        block ``transformer_blocks.N``): its runtime module and the diffusers Linears that make its Q
        and K. Those are the ``q``/``k`` pieces of the fused Linears the model's loader builds under
        ``owner`` (Qwen-Image: image and text Q/K), or, where it fuses none, the ``to_q``/``to_k``
        projections under ``owner``."""
        under = [
            layer
            for layer in self.linear_layers()
            if self.diffusers_to_export(f"{layer}.weight").startswith(f"{owner}.")
        ]
        qk = [layer for layer in under if (self.tensors[f"{layer}.weight"].get("shard") in ("q", "k"))]
        qk = qk or [layer for layer in under if layer.rsplit(".", 1)[-1] in ("to_q", "to_k")]
        if not qk:
            raise CheckpointError(
                f"{owner!r} holds no attention Q/K projection of vLLM-Omni's {self.model_class} "
                f"(Linears under it: {under or 'none'})"
            )
        runtime = sorted({self.runtime_layer_name(layer) for layer in qk})
        common = os.path.commonprefix([name.split(".") for name in runtime])
        if len(runtime) == 1:  # one fused Q/K/V Linear: the attention is its parent
            common = common[:-1]
        return ".".join(common), qk


def derived_model_names(
    directory: Path,
    class_name: str,
    config: Mapping[str, Any],
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    provider: Callable[..., dict],
    pipeline: str | None = None,
    export_names: str = DIFFUSERS_EXPORT_NAMES,
) -> ModelNames:
    """The runtime names of the transformer in ``directory`` from vLLM-Omni's ``class_name``
    (``pipeline`` says which model folder to look in first): ``tensors`` are its tensors as the BF16
    original holds them (name -> safetensors dtype, shape), ``provider`` is
    :func:`vllm_omni_mxfp4.models.derive_names` or a stand-in. A failure of the class's code is a
    :class:`CheckpointError` naming the directory and the class."""
    try:
        data = provider(pipeline, class_name, dict(config), dict(tensors))
    except CheckpointError:
        raise
    except Exception as exc:  # the provider runs vLLM-Omni's model code
        raise CheckpointError(
            f"{directory}: cannot derive the runtime names of {class_name!r} from vLLM-Omni "
            f"({type(exc).__name__}: {exc}); the checkpoint must be that class's (config.json _class_name), "
            "and vLLM-Omni the version that will serve it"
        ) from exc
    return ModelNames.from_dict(data, export_names)


def names_of_class(
    directory: Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    provider: Callable[..., dict],
    pipeline: str | None = None,
) -> ModelNames:
    """:func:`derived_model_names` of ``config``'s ``_class_name``, every one of ``tensors`` being one
    the class loads (a :class:`CheckpointError` naming the tensor otherwise): the names convert and
    load-time requantization use for a class without a fixed table."""
    names = derived_model_names(
        directory, str(config.get("_class_name")), config, tensors, provider, pipeline
    )
    for name in tensors:
        names.check_loaded(name, str(directory))
    return names
