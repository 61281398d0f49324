"""One NVFP4 transformer directory planned as an MXFP4 one: what each layer becomes, and every output tensor.

Detection (:func:`~vllm_omni_mxfp4.sources.nvfp4.detect_nvfp4`) says what each stored module is;
the target model (:mod:`.targets`) says which Linears vLLM-Omni builds as quantizable vLLM Linears
and which it fuses. Each module then becomes:

- ``mxfp4``: an NVFP4 Linear the target quantizes: requantized under the chosen rule, written as
  packed ``weight`` + E8M0 ``weight_scale`` (+ ``bias``; a ``pre_quant_scale`` becomes the Smooth
  ``mul_scale``);
- ``bf16``: an NVFP4 Linear the target runs as a plain ``nn.Linear``, an FP8 layer of a mixed
  checkpoint, or a member of a fused group (Q/K/V) whose other members are not NVFP4: its exact
  dequant rounded once to BF16 (at least the stored precision), listed in ``ignored_layers`` where
  the target would quantize it;
- ``kept``: stored unquantized by the producer (its excludes), copied byte for byte and listed in
  ``ignored_layers`` where the target would quantize it.

Every other tensor is copied unchanged, except the NVFP4 leftovers the MXFP4 layout has no use for
(``input_scale``, ``weight_scale_2`` / ``weight_global_scale``, Comfy markers). A tensor that fits
none of these is refused, naming it. Nothing here runs numerics: the plan's tensors compute their
bytes when the writer reaches them (:mod:`.tensors`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_omni_mxfp4 import spec
from vllm_omni_mxfp4.config import Mxfp4Config
from vllm_omni_mxfp4.config.keys import layer_order
from vllm_omni_mxfp4.errors import CheckpointError, read_json_object
from vllm_omni_mxfp4.models import derive_names
from vllm_omni_mxfp4.models.names import NamesProvider
from vllm_omni_mxfp4.safetensors_io import (
    CopyBytes,
    OutputTensor,
    TensorRef,
    open_archive,
    split_into_shards,
)
from vllm_omni_mxfp4.sources.nvfp4 import LayerSource, SourceError, detect_nvfp4, original_tensors
from vllm_omni_mxfp4.sources.nvfp4.names import Renamed, bfl_module, bfl_param, is_bfl
from vllm_omni_mxfp4.sources.nvfp4.routing import decide_linear, part_action

from .reader import TensorReader
from .targets import TARGETS, TargetModel, derived_target
from .tensors import DequantizedToBf16, Float32Of, LayerCache, RequantLayer, RequantTensor, RowsOf

DROPPED_PARAMS = frozenset({"input_scale", "comfy_quant", "weight_scale_2", "weight_global_scale"})
"""NVFP4 tensors the MXFP4 layout has no use for (activations are quantized dynamically)."""
NVFP4_ONLY_FILES = frozenset({"config.json", "hf_quant_config.json"})
"""Component files the convert rewrites (config.json) or drops (a ModelOpt config would say NVFP4)."""


@dataclass
class LayerReport:
    """What one output module became: ``mxfp4``, ``bf16`` or ``kept``, why, and the requant error."""

    name: str
    source: str
    action: str
    reason: str
    rule: str | None = None
    rel_rms: float | None = None
    max_abs: float | None = None
    exact_blocks: int | None = None
    total_blocks: int | None = None


@dataclass
class ConvertedComponent:
    """One converted transformer directory (``name``: its folder in the pipeline, ``.`` alone)."""

    name: str
    input_dir: str
    producer: str
    origin: str
    model_class: str
    scale_rule: str
    layers: list[LayerReport]
    ignored_layers: list[str]
    bytes_in: int
    warnings: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    bytes_out: int = 0
    seconds: float = 0.0

    def count(self, action: str) -> int:
        """How many output modules have ``action``."""
        return sum(1 for layer in self.layers if layer.action == action)


@dataclass
class ComponentPlan:
    """Everything needed to write one component: report, tensors in shards, config, extra files."""

    report: ConvertedComponent
    shards: list[list[OutputTensor]]
    config: dict
    extra_files: list[Path]
    errors: dict[str, object]
    reader: TensorReader


@dataclass(frozen=True)
class _Decision:
    source: LayerSource
    part: Renamed
    action: str
    reason: str


def _component_config(directory: Path) -> dict:
    return read_json_object(
        directory / "config.json",
        if_missing="the convert needs the transformer's diffusers config.json (copy the model's "
        "transformer/config.json there)",
    )


def _target(
    directory: Path, config: dict, archive: dict[str, TensorRef], checkpoint, provider
) -> TargetModel:
    """The fixed table of a class :mod:`.targets` knows, else the one derived from vLLM-Omni's class."""
    fixed = TARGETS.get(config.get("_class_name"))
    if fixed is not None:
        return fixed
    return derived_target(directory, config, original_tensors(archive, checkpoint.layers), provider)


def _archive(directory: Path) -> dict[str, TensorRef]:
    files = sorted(directory.glob("*.safetensors"))
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    if len(indexes) > 1:
        raise CheckpointError(f"{directory}: several safetensors index files {[p.name for p in indexes]}")
    return open_archive(files, indexes[0] if indexes else None)


def _modules(layers, rename: Callable[[str], tuple[Renamed, ...]], target: TargetModel) -> list[_Decision]:
    """Each output module's action: the parts of one runtime Linear decided together (the shared
    NVFP4 decision, :func:`~vllm_omni_mxfp4.sources.nvfp4.routing.decide_linear`); a module of no
    quantizable Linear is requantized nowhere (kept or dequantized as its source says)."""
    parts = [(layer, part) for layer in layers.values() for part in rename(layer.name)]
    groups: dict[str, list[tuple[LayerSource, Renamed]]] = defaultdict(list)
    for layer, part in parts:
        key = target.runtime_name(part.name) if target.quantizable(part.name) else f"plain:{part.name}"
        groups[key].append((layer, part))
    decided = {}
    for members in groups.values():
        name = members[0][1].name
        quantizable = target.quantizable(name)
        runtime = target.runtime_name(name) if quantizable else name
        decision = decide_linear([layer for layer, _ in members], quantizable, target.class_name, runtime)
        for layer, part in members:
            decided[part.name] = _Decision(layer, part, part_action(layer, decision), decision.reason)
    return [decided[part.name] for _, part in parts]


def _ignored(decisions: list[_Decision], target: TargetModel) -> list[str]:
    names = {
        target.runtime_name(d.part.name)
        for d in decisions
        if d.action != "mxfp4" and target.quantizable(d.part.name)
    }
    return sorted(names, key=layer_order)


def _warnings(decisions: list[_Decision], target: TargetModel) -> list[str]:
    """Weight-only NVFP4 layers (``W4A16_NVFP4``): MXFP4 serves them W4A4 unless the run says
    otherwise, and a checkpoint cannot carry that runtime policy; say so rather than lower silently."""
    weight_only = sorted(
        {
            target.runtime_name(d.part.name)
            for d in decisions
            if d.action == "mxfp4" and "W4A16" in d.source.algo
        },
        key=layer_order,
    )
    if not weight_only:
        return []
    return [
        f"{len(weight_only)} layers were W4A16_NVFP4 (16-bit activations); served as MXFP4 they quantize "
        f"activations to 4 bits unless listed in w4a8_fallback_layers at run time: {', '.join(weight_only)}"
    ]


def _require_smooth(decisions: list[_Decision]) -> bool:
    quantized = [d for d in decisions if d.action == "mxfp4"]
    return bool(quantized) and all("mul_scale" in d.source.tensors for d in quantized)


def plan_conversion(
    directory: Path,
    name: str,
    rule: str,
    max_shard_size: int | None,
    provider: NamesProvider = derive_names,
    workers: int = 1,
) -> ComponentPlan:
    """Plan one NVFP4 transformer directory; raises :class:`CheckpointError` naming what is refused.
    ``provider`` gives the runtime names of a class :mod:`.targets` has no table for; ``workers``: the
    requantization's threads (:func:`vllm_omni_mxfp4.kernels.requant.requantize_nvfp4`)."""
    try:
        checkpoint = detect_nvfp4(directory)
    except SourceError as exc:
        raise CheckpointError(f"{directory}: {exc}") from None
    if checkpoint is None:
        raise CheckpointError(
            f"{directory}: nothing declares NVFP4 (no NVFP4 quantization_config, hf_quant_config.json or "
            "Comfy marker); convert reads NVFP4 checkpoints only"
        )
    config = _component_config(directory)
    archive = _archive(directory)
    target = _target(directory, config, archive, checkpoint, provider)
    bfl = is_bfl(archive)
    rename = bfl_module if bfl else (lambda module: (Renamed(module),))
    try:
        decisions = _modules(checkpoint.layers, rename, target)
    except SourceError as exc:
        raise CheckpointError(f"{directory}: {exc}") from None
    if not any(d.action == "mxfp4" for d in decisions):
        raise CheckpointError(
            f"{directory}: no NVFP4 layer is one {target.class_name} quantizes (block Linears); "
            "there is nothing to convert to MXFP4"
        )
    reader = TensorReader(archive)
    builder = _Builder(reader, rule, directory, bfl, workers)
    for d in decisions:
        builder.add_module(d)
    builder.add_leftovers(archive)
    ignored = _ignored(decisions, target)
    quant = Mxfp4Config(
        is_checkpoint_mxfp4_serialized=True,
        ignored_layers=tuple(ignored),
        require_smooth_scale=_require_smooth(decisions),
    ).to_checkpoint_dict()
    report = ConvertedComponent(
        name, str(directory), checkpoint.producer, checkpoint.origin, target.class_name, rule,
        [LayerReport(d.part.name, d.source.name, d.action, d.reason, rule if d.action == "mxfp4" else None)
         for d in sorted(decisions, key=lambda d: layer_order(d.part.name))],
        ignored, sum(path.stat().st_size for path in {ref.path for ref in archive.values()}),
    )  # fmt: skip
    report.warnings = _warnings(decisions, target)
    config = {k: v for k, v in config.items() if k != "quantization_config"} | {"quantization_config": quant}
    shards = split_into_shards(builder.outputs, max_shard_size, builder.write_order)
    extras = sorted(
        p
        for p in directory.iterdir()
        if p.name not in NVFP4_ONLY_FILES and not p.name.endswith((".safetensors", ".safetensors.index.json"))
    )
    return ComponentPlan(report, shards, config, extras, builder.errors, reader)


class _Builder:
    """Collects the output tensors of a component, module by module."""

    def __init__(self, reader: TensorReader, rule: str, directory: Path, bfl: bool, workers: int = 1) -> None:
        self.reader, self.rule, self.directory, self.bfl, self.workers = reader, rule, directory, bfl, workers
        self.cache = LayerCache()
        self.errors: dict[str, object] = {}
        self.outputs: list[OutputTensor] = []
        self.consumed: set[str] = set()
        self._requant: dict[str, RequantLayer] = {}
        self._names: set[str] = set()
        self.source_of: dict[str, str] = {}

    def _emit(self, name: str, dtype: str, shape: tuple[int, ...], source) -> None:
        if name in self._names:
            raise CheckpointError(f"{self.directory}: two input tensors map to the output tensor {name!r}")
        self._names.add(name)
        self.outputs.append(OutputTensor(name, dtype, tuple(shape), source))

    def _plain(self, key: str, out_name: str, part: Renamed) -> None:
        """A stored tensor under its output name: bytes copied, or the rows ``part`` takes."""
        ref = self.reader.ref(key)
        if part.parts == 1 and not part.swap_halves:
            self._emit(out_name, ref.dtype, ref.shape, CopyBytes(ref))
            return
        rows = ref.shape[0] // part.parts if ref.shape else 0
        if not ref.shape or ref.shape[0] % part.parts or (part.swap_halves and ref.shape[0] % 2):
            raise CheckpointError(f"{ref.path}: tensor {key!r} {ref.shape} cannot take the rows of {part}")
        shape = (rows, *ref.shape[1:])
        nbytes = ref.nbytes // part.parts
        self._emit(out_name, ref.dtype, shape, RowsOf(lambda key=key: self.reader.tensor(key), part, nbytes))

    def add_module(self, d: _Decision) -> None:
        """The output tensors of one module's decision, and which input tensors it used."""
        layer, part = d.source, d.part
        if d.action == "kept":  # every stored tensor of the module, as stored
            for key in self.reader.module_keys(layer.name):
                self._plain(key, f"{part.name}.{self.param(key)}", part)
                self.consumed.add(key)
            return
        self._check_params(layer)
        if "bias" in layer.tensors:
            self._plain(layer.tensors["bias"], f"{part.name}.bias", part)
        if layer.action == "requantize":
            self._nvfp4(d)
        else:
            n, k = self.reader.ref(layer.tensors["weight"]).shape
            self._emit(
                f"{part.name}.weight",
                "BF16",
                (n // part.parts, k),
                self._bf16(layer, part, (n // part.parts, k)),
            )

    def _check_params(self, layer: LayerSource) -> None:
        """Every stored tensor of the module is used or a known NVFP4 leftover; else refused."""
        used = set(layer.tensors.values())
        for key in self.reader.module_keys(layer.name):
            param = key.rpartition(".")[2]
            if key not in used and param not in DROPPED_PARAMS:
                raise CheckpointError(
                    f"{self.directory}: {layer.name}: tensor {key!r} has no place in an MXFP4 checkpoint "
                    f"({layer.action} layer); the convert does not know it, so it refuses rather than drop it"
                )
            self.consumed.add(key)

    def _nvfp4(self, d: _Decision) -> None:
        layer, part = d.source, d.part
        n, k = layer.shape
        rows = n // part.parts
        if d.action == "bf16":
            self._emit(f"{part.name}.weight", "BF16", (rows, k), self._bf16(layer, part, (rows, k)))
            return
        load = self.reader.nvfp4_loader(layer)
        if layer.name not in self._requant:
            self._requant[layer.name] = RequantLayer(
                layer.name, load, self.rule, self.cache, self.errors, self.workers
            )
        requant = self._requant[layer.name]
        groups = spec.ceil_div(k, spec.MX_BLOCK)
        self.source_of[f"{part.name}.weight"] = self.source_of[f"{part.name}.weight_scale"] = layer.name
        self._emit(
            f"{part.name}.weight", "U8", (rows, k // 2), RequantTensor(requant, "data", part, (rows, k // 2))
        )
        scale = RequantTensor(requant, "scale", part, (rows, groups))
        self._emit(f"{part.name}.weight_scale", "U8", (rows, groups), scale)
        if "mul_scale" in layer.tensors:
            if part.parts != 1 or part.swap_halves:
                raise CheckpointError(
                    f"{self.directory}: {layer.name}: a pre_quant_scale on a split BFL layer"
                )
            source = Float32Of(lambda key=layer.tensors["mul_scale"]: self.reader.tensor(key), k * 4)
            self._emit(f"{part.name}.mul_scale", "F32", (k,), source)

    def _bf16(self, layer: LayerSource, part: Renamed, shape: tuple[int, int]) -> DequantizedToBf16:
        """The BF16 output of a layer the target runs unquantized (a refusal names the file)."""
        where = str(self.reader.ref(layer.tensors["weight"]).path)
        return DequantizedToBf16(layer, self.reader.tensor, part, shape, where)

    def write_order(self, name: str) -> tuple:
        """Sort key of output tensors: by their source layer first, so that the parts of one
        requantized layer (BFL Q/K/V) are written one after the other from one computation."""
        return layer_order(self.source_of.get(name, name)), name

    def param(self, key: str) -> str:
        """The output parameter name of an input tensor key (BFL norms' ``scale`` is ``weight``)."""
        param = key.rpartition(".")[2]
        return bfl_param(param) if self.bfl else param

    def add_leftovers(self, archive: dict[str, TensorRef]) -> None:
        """Tensors of no described module (bare parameters, weightless norms): copied, renamed."""
        for key in sorted(archive, key=layer_order):
            if key in self.consumed:
                continue
            module, _, param = key.rpartition(".")
            if param in DROPPED_PARAMS:
                continue
            for part in bfl_module(module) if self.bfl and module else (Renamed(module),):
                out_param = self.param(key)
                self._plain(key, f"{part.name}.{out_param}" if part.name else out_param, part)
