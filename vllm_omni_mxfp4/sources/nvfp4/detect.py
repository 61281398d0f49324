"""Detection: a checkpoint directory described layer by layer, failing closed.

What is read, in order (no tensor data except the few-byte Comfy markers):

1. the producer config: ``config.json`` ``quantization_config``, else ``hf_quant_config.json``, else
   the ``quantization_config`` JSON a safetensors header carries (:mod:`.config`);
2. every ``*.safetensors`` header in the directory: tensor names, dtypes, shapes and metadata;
3. Comfy markers: a ``<layer>.comfy_quant`` uint8 tensor holding JSON (``{"format": "nvfp4"}``), or,
   in a file with no producer config, the header's ``_quantization_metadata`` layer table.

Each module that has a weight becomes a :class:`~.records.LayerSource`. The stored tensors decide
the action (NVFP4 -> ``requantize``, FP8 -> ``dequantize``, floating -> ``keep``); the config is
checked against them, and any contradiction is refused rather than guessed (docs/nvfp4.md lists
every refusal). Conventions that the bytes cannot show are taken from the producer: ModelOpt and
compressed-tensors pack the even element in the low nibble, Comfy (comfy-kitchen) in the high
one; SGLang's ``swap_weight_nibbles`` says so explicitly. Scale layouts are read from the shapes
where they differ (a swizzled scale tensor is padded to 128x4 tiles); where they coincide, from
the producer's declaration, else from the other layers of the same checkpoint, else refused.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_omni_mxfp4 import spec
from vllm_omni_mxfp4.safetensors_io import TensorInfo, read_header

from .config import DEQUANT_ALGOS, REQUANT_ALGOS, ProducerConfig, parse_quant_config
from .records import LayerSource, Nvfp4Checkpoint, SourceError

WEIGHT_PARAMS = ("weight", "weight_packed")
SVDQUANT_PARAMS = (
    "svdquant_lora_a",
    "svdquant_lora_b",
    "proj_down",
    "proj_up",
    "qweight",
    "wscales",
    "smooth_factor",
)
GLOBAL_MULTIPLIER = "weight_scale_2"
GLOBAL_DIVISOR = "weight_global_scale"
COMFY_MARKER = "comfy_quant"
COMFY_DEQUANT_FORMATS = ("float8_e4m3fn", "mxfp8")
COMFY_CONVENTIONS = {"nibble_order": "high_even", "scale_layout": "swizzled"}


# ------------------------------------------------------------------------------------ reading


def read_checkpoint_headers(model_dir: Path) -> tuple[dict[str, TensorInfo], dict[str, str], dict[str, Path]]:
    """Tensors (name -> :class:`~vllm_omni_mxfp4.safetensors_io.TensorInfo`), merged header
    metadata, and the file of each tensor, for every ``*.safetensors`` file directly in
    ``model_dir`` (:func:`~vllm_omni_mxfp4.safetensors_io.read_header`: every header checked
    against its file)."""
    tensors, metadata, files = {}, {}, {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        entries, meta = read_header(path)
        metadata.update(meta)
        for name, ref in entries.items():
            tensors[name] = ref
            files[name] = path
    return tensors, metadata, files


def original_tensors(
    tensors: Mapping[str, TensorInfo], layers: Mapping[str, LayerSource]
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A component's tensors (name -> (dtype, shape)) as its BF16 original holds them, which is what
    the model class loads: an NVFP4 or FP8 layer's ``weight`` at its full ``(N, K)`` in BF16 and its
    ``bias``, none of its scales; every other tensor as stored, Comfy markers aside."""
    out = {}
    for name, info in tensors.items():
        module, _, param = name.rpartition(".")
        layer = layers.get(module)
        if param == COMFY_MARKER:
            continue
        if layer is None or layer.action == "keep" or param == "bias":
            out[name] = (info.dtype, tuple(info.shape))
        elif name == layer.tensors.get("weight"):
            out[f"{module}.weight"] = ("BF16", tuple(layer.shape or info.shape))
    return out


def _read_markers(files: Mapping[str, Path]) -> dict[str, dict[str, Any]]:
    """Decoded ``<module>.comfy_quant`` markers (JSON in a uint8 tensor), by module."""
    from safetensors import safe_open

    markers = {}
    for name, path in files.items():
        module, _, param = name.rpartition(".")
        if param != COMFY_MARKER:
            continue
        with safe_open(str(path), framework="numpy") as f:
            raw = bytes(f.get_tensor(name).tobytes())
        try:
            markers[module] = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SourceError(
                module, f"unreadable .comfy_quant marker ({exc})", "the file is corrupt"
            ) from None
    return markers


def _header_markers(metadata: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """The per-layer table of a header's ``_quantization_metadata`` (``{"layers": {...}}``), if any."""
    raw = metadata.get("_quantization_metadata")
    if not raw:
        return {}
    layers = json.loads(raw).get("layers")
    if not isinstance(layers, dict):
        raise SourceError("_quantization_metadata", "no 'layers' table in the safetensors header")
    return layers


def _load_json(path: Path) -> Any:
    """A JSON file's content, or a :class:`SourceError` naming it."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SourceError(str(path), f"unreadable JSON ({exc})") from None


def _producer_config(model_dir: Path, metadata: Mapping[str, str]) -> ProducerConfig | None:
    """The first NVFP4 config among config.json, hf_quant_config.json and the safetensors header.

    A ModelOpt HF export whose headers carry no quantization metadata was not post-processed for
    single-file runtimes, the only ModelOpt step that swizzles scales: its layout is linear.
    """
    config_json = model_dir / "config.json"
    cfg = _load_json(config_json).get("quantization_config") if config_json.is_file() else None
    found = parse_quant_config(cfg, f"{config_json} quantization_config") if cfg else None
    nested = model_dir / "hf_quant_config.json"
    if found is None and nested.is_file():
        found = parse_quant_config(_load_json(nested), str(nested))
    if found is None and metadata.get("quantization_config"):
        found = parse_quant_config(json.loads(metadata["quantization_config"]), "safetensors header")
    untouched = not ({"quantization_config", "_quantization_metadata"} & set(metadata))
    if found is not None and found.producer == "modelopt" and found.scale_layout is None and untouched:
        found = dataclasses.replace(found, scale_layout="linear")
    return found


def detect_nvfp4(model_dir: str | Path) -> Nvfp4Checkpoint | None:
    """Describe the NVFP4 checkpoint in ``model_dir`` (a diffusers component or a single-file dir).

    Returns None when nothing there declares NVFP4 (no NVFP4 config; no Comfy marker, or FP8 ones
    only), so a loader can fall through to its other formats. Raises :class:`~.records.SourceError` for an
    NVFP4 checkpoint with a layer we would not reproduce exactly.
    """
    model_dir = Path(model_dir)
    tensors, metadata, files = read_checkpoint_headers(model_dir)
    config = _producer_config(model_dir, metadata)
    markers = _read_markers(files)
    if not markers and config is None:
        markers = _header_markers(metadata)
    if markers:
        if all(m.get("format") in COMFY_DEQUANT_FORMATS for m in markers.values()):
            return None  # an FP8-only Comfy file is not an NVFP4 source
        excludes = config.excludes if config else ()
        config = ProducerConfig(
            "comfy", "Comfy .comfy_quant markers", "NVFP4", excludes=excludes, **COMFY_CONVENTIONS
        )
    if config is None:
        return None
    return describe_layers(tensors, config, markers)


# --------------------------------------------------------------------------------- describing


def _modules(tensors: Mapping[str, TensorInfo]) -> dict[str, dict[str, str]]:
    """module -> {param: key} for every module that has a weight (``weight`` or ``weight_packed``)."""
    params: dict[str, dict[str, str]] = defaultdict(dict)
    for key in tensors:
        module, _, param = key.rpartition(".")
        params[module][param] = key
    return {m: p for m, p in params.items() if any(w in p for w in WEIGHT_PARAMS)}


def _scale_layouts(n: int, k: int, scale: TensorInfo, name: str) -> set[str]:
    """The scale layouts a ``weight_scale`` shape fits for an ``(N, K)`` weight (refused if none)."""
    groups = k // spec.NVFP4_BLOCK
    tile_rows, tile_cols = spec.NVFP4_SCALE_TILE
    linear = (n, groups)
    swizzled = (spec.round_up(n, tile_rows), spec.round_up(groups, tile_cols))
    fits = {layout for layout, shape in (("linear", linear), ("swizzled", swizzled)) if scale.shape == shape}
    if fits:
        return fits
    if len(scale.shape) == 2 and scale.shape[0] in (linear[0], swizzled[0]):
        reason = f"weight_scale shape {scale.shape} contradicts the group size {spec.NVFP4_BLOCK} for K={k}"
    else:
        reason = f"weight_scale shape {scale.shape} is neither linear {linear} nor swizzled {swizzled}"
    raise SourceError(name, reason, "the file is not a supported NVFP4 layout; re-export it")


def _nvfp4_roles(name: str, params: Mapping[str, str], tensors: Mapping[str, TensorInfo]) -> dict[str, str]:
    """Checkpoint keys of an NVFP4 layer's tensors by role, refusing a missing or odd global scale
    and a ``pre_quant_scale`` that is not a ``(K,)`` input multiplier. The global scale's name says
    its kind: ``weight_scale_2`` multiplies, compressed-tensors' ``weight_global_scale`` divides."""
    weight = params.get("weight_packed") or params["weight"]
    k = tensors[weight].shape[1] * 2
    roles = {"weight": weight, "weight_scale": params["weight_scale"]}
    glob = params.get(GLOBAL_DIVISOR) or params.get(GLOBAL_MULTIPLIER)
    if glob is None or tensors[glob].shape not in ((), (1,)) or tensors[glob].dtype != "F32":
        found = tensors[glob] if glob else "nothing"
        raise SourceError(
            name,
            f"NVFP4 needs a float32 scalar {GLOBAL_MULTIPLIER} or {GLOBAL_DIVISOR}, found {found}",
            "re-export it",
        )
    roles["global_scale"] = glob
    pre = params.get("pre_quant_scale")
    if pre is not None:
        info = tensors[pre]
        if info.shape != (k,) or info.dtype not in spec.FLOAT_DTYPES:
            raise SourceError(
                name,
                f"pre_quant_scale {info.dtype} {info.shape} cannot be folded into the ({k},) Smooth multiplier",
                "serve this layer unquantized (add it to ignored_layers) or re-export without AWQ",
            )
        roles["mul_scale"] = pre
    if "bias" in params:
        roles["bias"] = params["bias"]
    return roles


def _check_declared(name: str, config: ProducerConfig, marker: Mapping[str, Any] | None) -> str:
    """The layer's declared algorithm, refusing an exclude or a declaration that contradicts NVFP4."""
    excluded = config.excluded_by(name)
    if excluded:
        raise SourceError(
            name,
            f"stored as NVFP4 but excluded by {excluded}",
            "the config and the tensors disagree; re-export it",
        )
    algo = "NVFP4" if marker is not None else config.algo_of(name)
    if algo is None:
        raise SourceError(
            name, "stored as NVFP4 but not listed in quantized_layers", "re-export the checkpoint"
        )
    if algo not in REQUANT_ALGOS:
        raise SourceError(name, f"stored as NVFP4 but declared {algo}", "re-export the checkpoint")
    return algo


def _nvfp4_layer(
    name: str,
    params: Mapping[str, str],
    tensors: Mapping[str, TensorInfo],
    config: ProducerConfig,
    marker: Mapping[str, Any] | None,
) -> tuple[LayerSource, set[str]]:
    """An NVFP4 layer (to requantize) and the scale layouts its shapes allow."""
    algo = _check_declared(name, config, marker)
    roles = _nvfp4_roles(name, params, tensors)
    n, half_k = tensors[roles["weight"]].shape
    layouts = _scale_layouts(n, half_k * 2, tensors[roles["weight_scale"]], name)
    declared = config.scale_layout
    if declared is not None and declared not in layouts:
        raise SourceError(
            name,
            f"{config.origin} declares {declared} scales but weight_scale {tensors[roles['weight_scale']].shape} "
            f"fits only {sorted(layouts)}",
            "the config and the tensors disagree; re-export it",
        )
    layout = declared if declared is not None else (next(iter(layouts)) if len(layouts) == 1 else None)
    source = LayerSource(
        name, "requantize", algo, f"NVFP4 by {config.producer}", roles, (n, half_k * 2),
        config.nibble_order, layout, roles["global_scale"].endswith(GLOBAL_DIVISOR),
    )  # fmt: skip
    return source, layouts


def _is_nvfp4(params: Mapping[str, str], tensors: Mapping[str, TensorInfo]) -> bool:
    """Packed uint8 weight with an FP8 E4M3 ``weight_scale``: NVFP4 in every producer's naming."""
    weight = params.get("weight_packed") or params.get("weight")
    scale = params.get("weight_scale")
    return bool(scale) and tensors[weight].dtype == "U8" and tensors[scale].dtype == "F8_E4M3"


def _other_layer(name, params, tensors, config) -> LayerSource:
    """A layer that is not NVFP4: FP8 (``dequantize``), floating (``keep``), anything else refused."""
    weight = tensors[params.get("weight") or params["weight_packed"]]
    roles = {r: params[r] for r in ("weight", "weight_scale", "bias") if r in params}
    declared = config.algo_of(name) if config.algo == "MIXED_PRECISION" else None
    if weight.dtype == "F8_E4M3" and "weight_scale" in params:
        if declared not in (None, *DEQUANT_ALGOS):
            raise SourceError(name, f"stored as FP8 but declared {declared}", "re-export the checkpoint")
        return LayerSource(
            name, "dequantize", "FP8", "FP8 layer, served in BF16 (FP8 precision or better)", roles
        )
    if weight.dtype in spec.FLOAT_DTYPES:
        if declared is not None:
            raise SourceError(
                name, f"declared {declared} but stored as {weight.dtype}", "re-export the checkpoint"
            )
        excluded = config.excluded_by(name)
        reason = f"excluded by {excluded}" if excluded else "stored unquantized by the producer"
        return LayerSource(name, "keep", weight.dtype, reason, roles)
    raise SourceError(
        name, f"unidentified tensors {sorted(params)} (weight {weight.dtype} {weight.shape})", "re-export it"
    )


def _comfy_layer(name, params, tensors, config, marker) -> tuple[LayerSource, set[str]]:
    """A layer with a Comfy marker: NVFP4, an FP8 format (dequantize), or refused (convrot, unknown)."""
    fmt = str(marker.get("format", ""))
    if marker.get("convrot") or fmt.startswith("convrot"):
        raise SourceError(
            name,
            f"rotated layer (convrot, format {fmt!r}) needs the inverse rotation",
            "use an unrotated export",
        )
    if fmt == "nvfp4" and _is_nvfp4(params, tensors):
        return _nvfp4_layer(name, params, tensors, config, marker)
    if fmt in COMFY_DEQUANT_FORMATS:
        return _other_layer(name, params, tensors, config), set()
    raise SourceError(name, f"unknown or mismatched Comfy format {fmt!r}", "use an NVFP4 export")


def _describe(name, params, tensors, config, marker) -> tuple[LayerSource, set[str]]:
    """One module: SVDQuant refused, then by marker or by stored tensors."""
    svd = sorted(set(params) & set(SVDQUANT_PARAMS))
    if svd:
        raise SourceError(
            name, f"SVDQuant low-rank branch ({', '.join(svd)})", "use a plain NVFP4 export or the BF16 model"
        )
    if marker is not None:
        return _comfy_layer(name, params, tensors, config, marker)
    if _is_nvfp4(params, tensors):
        return _nvfp4_layer(name, params, tensors, config, None)
    return _other_layer(name, params, tensors, config), set()


def _resolve_layouts(described: dict[str, tuple[LayerSource, set[str]]], config: ProducerConfig) -> None:
    """Give ambiguous layers (shape fits both layouts) the layout of the checkpoint's unambiguous
    ones, when those agree; otherwise refuse, naming the layer."""
    evidence = {next(iter(fits)) for _, fits in described.values() if len(fits) == 1}
    for name, (layer, _) in described.items():
        if layer.action != "requantize" or layer.scale_layout is not None:
            continue
        if len(evidence) != 1:
            raise SourceError(
                name,
                f"cannot tell linear from swizzled scales: the shape fits both and {config.origin} declares neither",
                "set checkpoint_weight_scale_layout ('linear' or 'swizzled') in quantization_config",
            )
        described[name] = (dataclasses.replace(layer, scale_layout=next(iter(evidence))), set())


def describe_layers(
    tensors: Mapping[str, TensorInfo],
    config: ProducerConfig,
    markers: Mapping[str, Mapping[str, Any]] | None = None,
) -> Nvfp4Checkpoint:
    """Describe every module with a weight, given the headers' tensors, the producer config and the
    Comfy markers by module. Raises :class:`~.records.SourceError` on the first refused layer."""
    markers = markers or {}
    described = {
        name: _describe(name, params, tensors, config, markers.get(name))
        for name, params in sorted(_modules(tensors).items())
    }
    _resolve_layouts(described, config)
    if not any(layer.action == "requantize" for layer, _ in described.values()):
        raise SourceError(
            config.origin, "declares NVFP4 but no layer stores NVFP4 tensors", "check the directory"
        )
    return Nvfp4Checkpoint(config.producer, config.origin, {n: layer for n, (layer, _) in described.items()})
