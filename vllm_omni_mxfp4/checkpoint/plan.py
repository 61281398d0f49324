"""Validate one transformer's msModelSlim export against its BF16 original and plan the merged output.

Planning reads safetensors headers and the small scale tensors only; it decides, for every output
tensor, which input bytes it is made of. Everything that can be wrong with the inputs is found here,
before anything is written, so ``--dry-run`` is exactly this step.

Rules (each violation is a :class:`CheckpointError` naming the tensor or file):

- every export tensor name is in the exact Wan2.2 name table and maps to a tensor (or, for
  quantization tensors, a Linear) of the original;
- a quantized Linear ``(N, K)`` has ``weight`` uint8 ``(N, K/2)``, ``weight_scale`` uint8
  ``(N, ceil(K/32))`` without the E8M0 NaN code 0xFF, for DualScale ``weight_dual_scale`` float32
  ``(N, ceil(K/512), 1)`` finite and >= 0 (msModelSlim writes 0 for an all-zero 512-block), its bias
  iff the original has one, and, when Smooth-wrapped, ``mul_scale`` floating ``(K,)`` finite and > 0;
- a FLOAT tensor is floating point with the original's shape; a Linear kept in BF16 has no scales
  and no Smooth (a BF16 Linear does not apply ``mul_scale`` at runtime);
- the self-attention Q/K/V of a block (fused at runtime) are all quantized or all BF16, and share
  one ``mul_scale`` (or none);
- only block Linears are quantized (vLLM-Omni runs the embedders and ``proj_out`` in BF16), unless
  the caller asks to take such layers from the original.

A DualScale layer that msModelSlim did not smooth gets an identity ``mul_scale`` (ones) in the
output: the DualScale runtime requires one for every quantized layer.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import CheckpointError
from .export import FLOAT_LABEL, QuantExport, read_export
from .names import (
    LINEAR,
    TensorName,
    diffusers_to_wan,
    fused_qkv_group,
    is_runtime_quantizable,
    natural_key,
    parse_diffusers,
    runtime_layer_name,
    strip_smooth_wrapper,
    wan_to_diffusers,
)
from .safetensors_io import (
    FLOAT_DTYPES,
    CopyBytes,
    OnesF32,
    OutputTensor,
    TensorRef,
    UnpackFp4ToBf16,
    WidenToF32,
    open_archive,
    plan_shards,
    read_index,
)

logger = logging.getLogger(__name__)

WEIGHTS_BASENAME = "diffusion_pytorch_model"
DESCRIPTION_NAME = "quant_model_description.json"
WEIGHT_LAYOUTS = ("packed", "numeric")
NON_BLOCK_POLICIES = ("error", "original")
TRANSFORMER_CLASS = "WanTransformer3DModel"
MX_BLOCK = 32
DUAL_BLOCK = 512
E8M0_NAN = 0xFF

_QUANT_LEAVES = ("weight_scale", "weight_dual_scale", "mul_scale")
_WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".index.json")


@dataclass
class TransformerReport:
    """What the merge did (or, in a dry run, would do) to one transformer."""

    name: str
    quant_dir: str
    description: str
    saver: str
    quant_method: str
    layers_quantized: int
    layers_bf16: int
    smooth_layers: int
    ignored_layers: list[str]
    require_smooth_scale: bool | None
    tensors: int
    tensors_from_original: int
    bytes_in: int
    bytes_out: int
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass
class TransformerPlan:
    """Everything needed to write one merged transformer directory."""

    report: TransformerReport
    original_dir: Path
    shards: list[list[OutputTensor]]
    config: dict
    description: dict[str, str]
    extra_files: list[Path]


@dataclass
class _ExportTensor:
    ref: TensorRef
    label: str
    export_name: str
    wrapped: bool
    place: TensorName


def original_archive(directory: Path) -> dict[str, TensorRef]:
    """The tensors of an original diffusers transformer directory (single file or sharded)."""
    index = directory / f"{WEIGHTS_BASENAME}.safetensors.index.json"
    single = directory / f"{WEIGHTS_BASENAME}.safetensors"
    if index.is_file():
        shards = sorted({directory / name for name in read_index(index).values()})
        return open_archive([p for p in shards if p.is_file()], index)
    if single.is_file():
        return open_archive([single])
    raise CheckpointError(
        f"{directory}: no {single.name} or {index.name}; the original transformer must be diffusers safetensors"
    )


def _export_layer(layer: str) -> str:
    return diffusers_to_wan(f"{layer}.weight")[: -len(".weight")]


def _fail(ref: TensorRef, what: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{ref.path}: {what} {ref.name!r} {problem}")


def _check(
    t: _ExportTensor, what: str, dtypes: frozenset[str] | set[str], shape: tuple[int, ...], why: str
) -> None:
    if t.ref.dtype not in dtypes:
        raise _fail(t.ref, what, f"has dtype {t.ref.dtype}; expected {' or '.join(sorted(dtypes))}")
    if t.ref.shape != shape:
        raise _fail(t.ref, what, f"has shape {list(t.ref.shape)}; expected {list(shape)} {why}")


def _first_index(mask: np.ndarray) -> list[int]:
    return [int(i) for i in np.argwhere(mask)[0]]


def _check_scale_codes(t: _ExportTensor) -> None:
    codes = t.ref.read_array()
    bad = codes == E8M0_NAN
    if bad.any():
        raise _fail(t.ref, "weight_scale", f"holds the E8M0 NaN code 0xFF at {_first_index(bad)}")


def _check_dual_scale(t: _ExportTensor) -> None:
    values = t.ref.read_array()
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        at = _first_index(bad)
        raise _fail(
            t.ref,
            "weight_dual_scale",
            f"holds {float(values[tuple(at)])} at {at}; expected finite values >= 0",
        )


def _check_mul_scale(t: _ExportTensor) -> np.ndarray:
    values = t.ref.read_array().astype(np.float32)
    bad = ~np.isfinite(values) | ~(values > 0)
    if bad.any():
        at = _first_index(bad)
        raise _fail(
            t.ref, "mul_scale", f"holds {float(values[tuple(at)])} at {at}; expected finite values > 0"
        )
    return values


def _map_export(export: QuantExport) -> dict[str, _ExportTensor]:
    mapped: dict[str, _ExportTensor] = {}
    for name in sorted(export.tensors, key=natural_key):
        stripped, wrapped = strip_smooth_wrapper(name)
        try:
            place = wan_to_diffusers(stripped)
        except CheckpointError:
            raise CheckpointError(
                f"{export.description}: unknown tensor {name!r}; it is not in the exact Wan2.2 "
                "original-name table (msModelSlim must quantize the original Wan modules)"
            ) from None
        if wrapped and place.kind != LINEAR:
            raise CheckpointError(
                f"{export.description}: Smooth wrapper name {name!r} on a non-Linear module"
            )
        if place.name in mapped:
            raise CheckpointError(
                f"{export.description}: tensors {mapped[place.name].export_name!r} and {name!r} "
                f"both map to {place.name!r}"
            )
        mapped[place.name] = _ExportTensor(export.tensors[name], export.labels[name], name, wrapped, place)
    return mapped


class _Planner:
    def __init__(self, name: str, original_dir: Path, export: QuantExport, layout: str, non_block: str):
        self.name = name
        self.original_dir = original_dir
        self.export = export
        self.layout = layout
        self.non_block = non_block
        self.original = original_archive(original_dir)
        self.places = {}
        for tensor in self.original:
            try:
                self.places[tensor] = parse_diffusers(tensor)
            except CheckpointError:
                raise CheckpointError(
                    f"{self.original[tensor].path}: original tensor {tensor!r} is not in the Wan2.2 name table"
                ) from None
        self.mapped = _map_export(export)
        self.by_layer: dict[str, dict[str, _ExportTensor]] = {}
        for t in self.mapped.values():
            if t.place.layer is not None and t.place.kind == LINEAR:
                self.by_layer.setdefault(t.place.layer, {})[t.place.leaf] = t
        self.warnings: list[str] = []

    def _warn(self, message: str) -> None:
        logger.warning("%s: %s", self.name, message)
        self.warnings.append(message)

    def _layer_context(self, layer: str) -> str:
        return f"{self.export.description.name}: layer {layer} (export {_export_layer(layer)})"

    def check_coverage(self) -> None:
        for t in self.mapped.values():
            if t.place.leaf in _QUANT_LEAVES:
                if f"{t.place.layer}.weight" not in self.original:
                    raise _fail(
                        t.ref, "tensor", f"belongs to Linear {t.place.layer!r}, which the original lacks"
                    )
            elif t.place.name not in self.original:
                raise _fail(
                    t.ref, "tensor", f"maps to {t.place.name!r}, which the original transformer lacks"
                )

    def linear_layers(self) -> list[str]:
        layers = {p.layer for p in self.places.values() if p.kind == LINEAR and p.leaf == "weight"}
        return sorted(layers, key=natural_key)

    def classify(self, layer: str) -> bool:
        """Whether one Linear is quantized in the export, after checking its tensors' consistency."""
        tensors = self.by_layer.get(layer, {})
        context = self._layer_context(layer)
        wrapped = {t.wrapped for t in tensors.values()}
        if len(wrapped) > 1:
            names = sorted(t.export_name for t in tensors.values())
            raise CheckpointError(f"{context}: mixes Smooth-wrapped and plain tensor names {names}")
        smooth = "mul_scale" in tensors
        if wrapped == {True} and not smooth:
            raise CheckpointError(
                f"{context}: Smooth-wrapped tensors without {_export_layer(layer)}.div.mul_scale"
            )
        weight = tensors.get("weight")
        quantized = weight is not None and weight.label != FLOAT_LABEL
        scales = [leaf for leaf in ("weight_scale", "weight_dual_scale") if leaf in tensors]
        if not quantized:
            if scales and weight is None:
                raise CheckpointError(f"{context}: quantized layer is missing its weight tensor")
            if scales:
                raise CheckpointError(f"{context}: labelled FLOAT but has {', '.join(scales)}")
            if smooth:
                raise CheckpointError(
                    f"{context}: kept in BF16 but carries a Smooth scale ({tensors['mul_scale'].export_name}); "
                    "a BF16 Linear does not apply mul_scale at runtime, so its smoothed weight would be wrong"
                )
        return quantized

    def check_quantized(self, layer: str) -> np.ndarray | None:
        """Check one quantized Linear's tensors; returns its ``mul_scale`` values (or ``None``)."""
        tensors = self.by_layer[layer]
        context = self._layer_context(layer)
        original = self.original[f"{layer}.weight"]
        if len(original.shape) != 2:
            raise CheckpointError(f"{context}: the original weight has shape {list(original.shape)}, not 2-D")
        n, k = original.shape
        label = self.export.label
        why = f"for the original Linear {layer} of shape [{n}, {k}]"
        for leaf in ("weight", "weight_scale") + (
            ("weight_dual_scale",) if label.endswith("DUALSCALE") else ()
        ):
            if leaf not in tensors:
                raise CheckpointError(
                    f"{context}: quantized ({label}) but {_export_layer(layer)}.{leaf} is missing"
                )
            if tensors[leaf].label != label:
                raise _fail(tensors[leaf].ref, leaf, f"is labelled {tensors[leaf].label}; expected {label}")
        if not label.endswith("DUALSCALE") and "weight_dual_scale" in tensors:
            raise _fail(
                tensors["weight_dual_scale"].ref, "tensor", f"is unexpected in a single-scale {label} layer"
            )
        if k % 2:
            raise CheckpointError(f"{context}: K = {k} is odd and cannot hold packed FP4 pairs")
        _check(tensors["weight"], "weight", {"U8"}, (n, k // 2), f"(N, K/2) {why}")
        _check(
            tensors["weight_scale"],
            "weight_scale",
            {"U8"},
            (n, math.ceil(k / MX_BLOCK)),
            f"(N, ceil(K/32)) {why}",
        )
        _check_scale_codes(tensors["weight_scale"])
        if "weight_dual_scale" in tensors:
            shape = (n, math.ceil(k / DUAL_BLOCK), 1)
            _check(
                tensors["weight_dual_scale"],
                "weight_dual_scale",
                {"F32"},
                shape,
                f"(N, ceil(K/512), 1) {why}",
            )
            _check_dual_scale(tensors["weight_dual_scale"])
        has_bias = f"{layer}.bias" in self.original
        if has_bias and "bias" not in tensors:
            raise CheckpointError(f"{context}: the original has a bias but the export has none")
        if "bias" in tensors:
            if not has_bias:
                raise _fail(tensors["bias"].ref, "bias", "exists but the original Linear has no bias")
            if tensors["bias"].label not in (FLOAT_LABEL, label):
                raise _fail(tensors["bias"].ref, "bias", f"is labelled {tensors['bias'].label}")
            _check(tensors["bias"], "bias", FLOAT_DTYPES, (n,), f"(N,) {why}")
        if "mul_scale" not in tensors:
            return None
        mul = tensors["mul_scale"]
        if mul.label != FLOAT_LABEL:
            raise _fail(mul.ref, "mul_scale", f"is labelled {mul.label}; msModelSlim labels it FLOAT")
        _check(mul, "mul_scale", FLOAT_DTYPES, (k,), f"(K,) {why}")
        return _check_mul_scale(mul)

    def check_float(self, t: _ExportTensor) -> None:
        if t.label != FLOAT_LABEL:
            raise _fail(t.ref, "tensor", f"is labelled {t.label} but is not part of a quantized Linear")
        original = self.original[t.place.name]
        _check(t, "FLOAT tensor", FLOAT_DTYPES, original.shape, f"(the original {t.place.name})")

    def check_qkv(self, status: dict[str, bool], smooth_values: dict[str, np.ndarray | None]) -> None:
        groups: dict[str, list[str]] = {}
        for layer in status:
            group = fused_qkv_group(layer)
            if group is not None:
                groups.setdefault(group, []).append(layer)
        for group, layers in groups.items():
            layers.sort(key=lambda layer: "qkv".index(layer[-1]))
            context = f"{self.export.description.name}: fused self-attention {group} (export {_export_layer(layers[0])[:-2]})"
            quantized = [layer.rsplit(".", 1)[1] for layer in layers if status[layer]]
            if quantized and len(quantized) != len(layers):
                bf16 = [layer.rsplit(".", 1)[1] for layer in layers if not status[layer]]
                raise CheckpointError(
                    f"{context}: partial BF16 fallback ({', '.join(quantized)} quantized, {', '.join(bf16)} BF16); "
                    "vLLM-Omni fuses Q/K/V into attn1.to_qkv, so all three must share one precision"
                )
            if not quantized:
                continue
            values = [smooth_values[layer] for layer in layers]
            if any(v is None for v in values) and not all(v is None for v in values):
                with_smooth = [layer.rsplit(".", 1)[1] for layer, v in zip(layers, values) if v is not None]
                raise CheckpointError(
                    f"{context}: Smooth mul_scale on {', '.join(with_smooth)} only; Q/K/V share one"
                )
            if values[0] is not None and not all(np.array_equal(values[0], v) for v in values[1:]):
                raise CheckpointError(
                    f"{context}: Q/K/V have different mul_scale tensors; the fused attn1.to_qkv applies one"
                )

    def plan(self, max_shard_size: int | None) -> TransformerPlan:
        self.check_coverage()
        status: dict[str, bool] = {}
        smooth_values: dict[str, np.ndarray | None] = {}
        dropped: set[str] = set()
        for layer in self.linear_layers():
            quantized = self.classify(layer)
            if quantized:
                smooth_values[layer] = self.check_quantized(layer)
                if not is_runtime_quantizable(layer):
                    if self.non_block == "error":
                        raise CheckpointError(
                            f"{self._layer_context(layer)}: is quantized, but vLLM-Omni runs this Linear in BF16 "
                            "(only block Linears are quantized); exclude it from quantization in msModelSlim or "
                            "pass --non-block-quantized original"
                        )
                    self._warn(f"{layer} is quantized in the export; its BF16 original is used instead")
                    dropped.add(layer)
                    quantized = False
            status[layer] = quantized
        self.check_qkv(status, smooth_values)

        outputs: list[OutputTensor] = []
        description: dict[str, str] = {}
        from_original = 0
        bytes_in = 0
        for name in sorted(self.original, key=natural_key):
            place = self.places[name]
            exported = self.mapped.get(name)
            if place.layer in dropped:
                exported = None
            if place.layer is not None and status.get(place.layer):
                if place.leaf == "weight":
                    continue
            elif exported is not None:
                self.check_float(exported)
            if exported is None:
                from_original += 1
                ref, label = self.original[name], FLOAT_LABEL
            else:
                ref, label = exported.ref, exported.label
            outputs.append(OutputTensor(name, ref.dtype, ref.shape, CopyBytes(ref)))
            description[name] = label
            bytes_in += ref.nbytes
        for layer in (layer for layer, q in status.items() if q):
            tensors = self.by_layer[layer]
            weight = tensors["weight"].ref
            if self.layout == "packed":
                outputs.append(OutputTensor(f"{layer}.weight", "U8", weight.shape, CopyBytes(weight)))
            else:
                shape = (weight.shape[0], weight.shape[1] * 2)
                outputs.append(OutputTensor(f"{layer}.weight", "BF16", shape, UnpackFp4ToBf16(weight)))
            description[f"{layer}.weight"] = self.export.label
            bytes_in += weight.nbytes
            if self.export.quant_method == "mxfp4_dualscale" and "mul_scale" not in tensors:
                # The DualScale runtime always applies a Smooth tensor: a layer msModelSlim did not
                # smooth gets the identity, which leaves its activations unchanged.
                k = weight.shape[1] * 2
                outputs.append(OutputTensor(f"{layer}.mul_scale", "F32", (k,), OnesF32(k)))
            for leaf in ("weight_scale", "weight_dual_scale", "mul_scale"):
                if leaf not in tensors:
                    continue
                ref = tensors[leaf].ref
                source = CopyBytes(ref) if ref.dtype in ("U8", "F32") else WidenToF32(ref)
                dtype = ref.dtype if ref.dtype in ("U8", "F32") else "F32"
                outputs.append(OutputTensor(f"{layer}.{leaf}", dtype, ref.shape, source))
                description[f"{layer}.{leaf}"] = tensors[leaf].label
                bytes_in += ref.nbytes
        description = {k: description[k] for k in sorted(description, key=natural_key)}
        description["model_quant_type"] = self.export.label

        quantized_layers = [layer for layer, q in status.items() if q]
        bf16_layers = [layer for layer, q in status.items() if not q]
        ignored = sorted({runtime_layer_name(layer) for layer in bf16_layers}, key=natural_key)
        smooth_count = sum(1 for layer in quantized_layers if smooth_values[layer] is not None)
        require_smooth = None
        if self.export.quant_method == "mxfp4":
            require_smooth = smooth_count == len(quantized_layers)
            if 0 < smooth_count < len(quantized_layers):
                self._warn(
                    f"Smooth on {smooth_count} of {len(quantized_layers)} quantized layers; require_smooth_scale "
                    "is false so that the others load with identity scaling"
                )
        if self.export.fa_markers:
            self._warn(f"{len(self.export.fa_markers)} FA3 attention-quantization marker(s) ignored")
        config = self._config(ignored, require_smooth)
        shards = plan_shards(outputs, max_shard_size, natural_key)
        report = TransformerReport(
            name=self.name,
            quant_dir=str(self.export.directory),
            description=self.export.description.name,
            saver=self.export.saver,
            quant_method=self.export.quant_method,
            layers_quantized=len(quantized_layers),
            layers_bf16=len(bf16_layers),
            smooth_layers=smooth_count,
            ignored_layers=ignored,
            require_smooth_scale=require_smooth,
            tensors=len(outputs),
            tensors_from_original=from_original,
            bytes_in=bytes_in,
            bytes_out=sum(t.nbytes for t in outputs),
            warnings=self.warnings,
        )
        return TransformerPlan(report, self.original_dir, shards, config, description, self._extra_files())

    def _config(self, ignored: list[str], require_smooth: bool | None) -> dict:
        path = self.original_dir / "config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(
                f"{path}: missing; the original transformer needs its config.json"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: cannot read ({exc})") from None
        if not isinstance(config, dict) or config.get("_class_name") != TRANSFORMER_CLASS:
            found = config.get("_class_name") if isinstance(config, dict) else None
            raise CheckpointError(f"{path}: _class_name is {found!r}; expected {TRANSFORMER_CLASS!r}")
        if "quantization_config" in config:
            raise CheckpointError(
                f"{path}: already has a quantization_config; --original-model must be the BF16 original"
            )
        if self.export.quant_method == "mxfp4_dualscale":
            quant = {
                "quant_method": "mxfp4_dualscale",
                "is_checkpoint_serialized": True,
                "ignored_layers": ignored,
            }
        else:
            quant = {
                "quant_method": "mxfp4",
                "is_checkpoint_mxfp4_serialized": True,
                "ignored_layers": ignored,
                "require_smooth_scale": require_smooth,
            }
        return {**config, "quantization_config": quant}

    def _extra_files(self) -> list[Path]:
        return sorted(
            p
            for p in self.original_dir.iterdir()
            if p.name not in ("config.json", DESCRIPTION_NAME) and not p.name.endswith(_WEIGHT_FILE_SUFFIXES)
        )


def plan_transformer(
    name: str,
    original_dir: Path,
    quant_dir: Path,
    *,
    weight_layout: str = "packed",
    max_shard_size: int | None = None,
    non_block_quantized: str = "error",
) -> TransformerPlan:
    """Validate one transformer's export against its original and plan the merged tensors."""
    if not original_dir.is_dir():
        raise CheckpointError(f"original transformer directory {original_dir} does not exist")
    export = read_export(quant_dir)
    planner = _Planner(name, original_dir, export, weight_layout, non_block_quantized)
    return planner.plan(max_shard_size)
