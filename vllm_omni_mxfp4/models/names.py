"""One transformer's names, export -> diffusers -> vLLM-Omni runtime, from its class's derived data.

:class:`ModelNames` reads the plain data :func:`~.derive.derive_names` derives from vLLM-Omni's model
class (where its ``load_weights`` puts each checkpoint tensor, each runtime Linear's kind and
quantization prefix); for exports in the original Wan repository's names it goes through the exact
Wan2.2 table of :mod:`.wan`. Pure Python (no torch): the merge reads it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.keys import layer_order
from ..errors import CheckpointError
from .records import piece_index
from .wan import (
    LINEAR,
    LINEAR_LEAVES,
    PARAM,
    PLAIN_LEAVES,
    TensorName,
    diffusers_to_wan,
    parse_diffusers,
    strip_smooth_wrapper,
    wan_to_diffusers,
)

#: How an export names its tensors: the original Wan repository's modules (msModelSlim's Wan
#: adapters quantize the Wan code's model; :func:`wan_to_diffusers` maps them) or the diffusers
#: checkpoint's (adapters that quantize a diffusers model, such as Qwen-Image-Edit's).
WAN_EXPORT_NAMES = "wan"
DIFFUSERS_EXPORT_NAMES = "diffusers"
EXPORT_NAMINGS = (WAN_EXPORT_NAMES, DIFFUSERS_EXPORT_NAMES)
#: ``(pipeline class, transformer class, config.json, tensors) -> data``: a transformer's runtime names
#: as plain data (:meth:`ModelNames.from_dict`); ``tensors`` maps each original tensor name to its
#: (safetensors dtype, shape). :func:`~.derive.derive_names` is the real one; tests pass stand-ins.
NamesProvider = Callable[
    [str | None, str, Mapping[str, Any], Mapping[str, tuple[str, tuple[int, ...]]]], dict
]
#: A module that is not a Linear, in a model whose names come from the class (no norm/conv split).
MODULE = "module"
_ANY_BLOCK_RE = re.compile(r"^(?:[A-Za-z0-9_]*blocks)\.(0|[1-9][0-9]*)\.")


def disagreeing_blocks(lists: Mapping[str, int], names: Iterable[str]) -> tuple[str, int, list[int]] | None:
    """The first block list of ``lists`` (path -> blocks built from ``config.json``) whose blocks
    differ from those tensors ``names`` hold (``<path>.<i>.*``), as ``(path, built, held)``; None
    when every list the tensors populate agrees."""
    names = list(names)
    for path, built in lists.items():
        pattern = re.compile(rf"^{re.escape(path)}\.(\d+)\.")
        held = sorted({int(m.group(1)) for m in map(pattern.match, names) if m})
        if held and held != list(range(built)):
            return path, built, held
    return None


def block_spans(indices: Iterable[int]) -> str:
    """``0-1`` or ``0-2, 4``: block indices as ranges."""
    spans: list[list[int]] = []
    for i in sorted(indices):
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def layer_count_keys(config: Mapping[str, Any], built: int) -> str:
    """`` (num_layers=3)``: the ``config.json`` keys that may have set a block count of ``built``."""
    keys = [f"{k}={v}" for k, v in config.items() if isinstance(v, int) and v == built and "layer" in k]
    return f" ({', '.join(keys)})" if keys else ""


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
    #: The class's top-level block lists built from ``config.json``, with their lengths.
    block_lists: dict[str, int] = field(default_factory=dict)

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
        return cls(
            str(data["model_class"]),
            export_names,
            dict(data["tensors"]),
            dict(data["linears"]),
            dict(data.get("block_lists") or {}),
        )

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
        return self.runtime_layer_name(layer), piece_index(placed["shard"])

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
