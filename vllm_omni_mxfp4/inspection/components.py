"""Inspect a checkpoint directory: its components, the method each gets, and every runtime Linear.

:func:`inspect_path` takes a diffusers pipeline (``model_index.json`` naming its components) or one
component directory (``config.json`` with ``_class_name``). For each transformer component:

1. the checkpoint kind: an NVFP4 export (:func:`vllm_omni_mxfp4.sources.nvfp4.detect_nvfp4`: what
   load-time requantization would do, layer by layer), a checkpoint with our
   ``quantization_config`` (the config auto-detection builds,
   :func:`vllm_omni_mxfp4.config.reconcile_with_checkpoint` with no runtime config), or a plain BF16
   model (then the rows show what ``--quantization mxfp4`` would quantize online);
2. the model walk (:mod:`.model`: vLLM-Omni's class on the meta device, the checkpoint traced
   through its own loader) and the layer-list names of the config against the built Linears;
3. a row per runtime Linear with its problems (:mod:`.checks`).

Only safetensors headers and small tensors (scales, Smooth vectors, biases) are read; nothing is
loaded onto an accelerator. ``OSError`` (a missing or unreadable path) propagates: the CLI exits 1
on it; everything wrong with the checkpoint itself is a problem in the report.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from vllm_omni_mxfp4.config import Mxfp4Config, QuantConfig, check_model_names, reconcile_with_checkpoint
from vllm_omni_mxfp4.config.names import STORAGE_RULE, describe_accepted
from vllm_omni_mxfp4.config.reconcile import checkpoint_method
from vllm_omni_mxfp4.errors import CheckpointError
from vllm_omni_mxfp4.safetensors_io import WEIGHTS_BASENAME, TensorRef, diffusers_archive, open_archive
from vllm_omni_mxfp4.sources.nvfp4 import Nvfp4Checkpoint, SourceError, detect_nvfp4
from vllm_omni_mxfp4.sources.nvfp4.routing import decide_linear

from ..models.records import ModelWalk
from .checks import attribute, base_row, layer_row
from .report import ComponentReport, InspectReport, LayerRow

logger = logging.getLogger(__name__)

ONLINE_NOTE = (
    "no quantization_config: a BF16 checkpoint; the rows show what online --quantization mxfp4 would "
    "quantize (mxfp4_dualscale online also keeps the first num_bf16_fallback_layers=5 blocks in BF16)"
)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; ``ValueError`` naming the file when it is not one (``OSError`` passes)."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def find_components(path: Path) -> tuple[str | None, list[tuple[str, Path]]]:
    """The pipeline class (``model_index.json`` ``_class_name``) and the components to inspect:
    every component directory with a ``config.json`` naming a ``_class_name`` whose name says it is a
    transformer, or ``path`` itself when it is one component."""
    index = path / "model_index.json"
    if not index.is_file():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path}: neither model_index.json (a pipeline) nor config.json (a component)"
            )
        return None, [(path.name, path)]
    entries = _read_json(index)
    components = [
        (name, path / name)
        for name, value in entries.items()
        if isinstance(value, list) and "transformer" in name and (path / name / "config.json").is_file()
    ]
    return entries.get("_class_name"), sorted(components)


def read_archive(directory: Path) -> dict[str, TensorRef]:
    """The tensors of a component (diffusers single file or sharded with its index, else every
    ``*.safetensors`` file in the directory): headers only."""
    if any(directory.glob(f"{WEIGHTS_BASENAME}.safetensors*")):
        return diffusers_archive(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    return open_archive(files)


def _detect(
    report: ComponentReport, directory: Path, config: dict[str, Any]
) -> tuple[Any, QuantConfig | None]:
    """The checkpoint kind and the config the model is built with (``None``: stop, a problem says why)."""
    try:
        nvfp4 = detect_nvfp4(directory)
    except SourceError as exc:
        report.problems.append(f"NVFP4 checkpoint refused: {exc}")
        return None, None
    if nvfp4 is not None:
        report.source = nvfp4.summary()
        report.method, report.mode = "mxfp4", "online, requantized from NVFP4 at load"
        return nvfp4, Mxfp4Config()
    qc = config.get("quantization_config")
    try:
        method = checkpoint_method(qc)[0]
        quant = reconcile_with_checkpoint(None, qc)
    except (TypeError, ValueError) as exc:
        report.problems.append(f"config.json quantization_config: {exc}")
        return None, None
    if method is None:
        report.source = "BF16 (config.json has no quantization_config)"
        report.notes.append(ONLINE_NOTE)
        return None, Mxfp4Config()
    report.source = "quantization_config in config.json (auto-detected, no --quantization needed)"
    report.method, report.mode = quant.METHOD, "offline" if quant.is_serialized else "online"
    report.facts = {k: v for k, v in quant.to_checkpoint_dict().items() if k != "quant_method"}
    return None, quant


def _nvfp4_row(row: LayerRow, nvfp4: Nvfp4Checkpoint) -> None:
    """What load-time requantization does to one runtime Linear, from its checkpoint modules (the
    shared NVFP4 decision, :func:`~vllm_omni_mxfp4.sources.nvfp4.routing.decide_linear`)."""
    sources = [nvfp4.layers[s] for s in row.sources if s in nvfp4.layers]
    if not sources:
        return
    quantizable = row.method != "bf16"  # the model gives this Linear our method
    decision = decide_linear(sources, quantizable, "the model", row.name)
    row.method, row.precision = decision.method, decision.precision
    if decision.quantized or quantizable or all(s.action == "keep" for s in sources):
        row.reason = decision.reason
    else:
        row.reason = f"{row.reason}: {sources[0].algo} served in BF16"


def _rows(walk: ModelWalk, archive: dict[str, TensorRef], quant: QuantConfig | None, nvfp4) -> list[LayerRow]:
    """A row per runtime Linear: checked against our format's rules, or described from the NVFP4
    source (whose own checks are :func:`detect_nvfp4`'s)."""
    feeds, _ = attribute(walk, archive)
    rows = []
    for lin in walk.linears:
        if nvfp4 is None:
            rows.append(layer_row(lin, feeds.get(lin.name, []), quant, walk.packed))
        else:
            rows.append(base_row(lin, feeds.get(lin.name, [])))
            _nvfp4_row(rows[-1], nvfp4)
    return rows


def _walk(report: ComponentReport, pipeline: str | None, config: dict, quant, archive) -> ModelWalk | None:
    from ..models.build import ModelError  # torch, vLLM: only when a model is walked
    from .walk import walk_model

    tensors = {name: (ref.dtype, ref.shape) for name, ref in archive.items()}
    try:
        walk = walk_model(report.class_name, pipeline, config, quant, tensors)
    except ModelError as exc:
        report.problems.append(str(exc))
        return None
    report.model_module = walk.module
    report.problems.extend(
        f"{name}: the model's loader refuses it ({p.error})" for name, p in walk.placements.items() if p.error
    )
    return walk


def _check_names(report: ComponentReport, quant: QuantConfig, walk: ModelWalk) -> None:
    """The config's layer lists against the built model. Its ``ignored_layers`` is the checkpoint's
    own (a BF16 checkpoint's online config has none), so the storage rule applies, as in the engine
    with the same checkpoint: entries naming modules that are not Linears are accepted, and noted."""
    if report.method and quant.ignored_layers:
        report.names_rule = STORAGE_RULE
    try:
        accepted = check_model_names(
            quant, [lin.name for lin in walk.linears], None, model=report.class_name,
            modules=walk.modules, storage=quant.ignored_layers if report.method else (),
        )  # fmt: skip
    except ValueError as exc:
        report.problems.append(f"config.json quantization_config: {exc}")
        return
    if accepted:
        report.notes.append(
            f"ignored_layers lists {len(accepted)} modules that are not Linears: {describe_accepted(accepted)}; "
            "they load as they are (accepted: the checkpoint's own list is a storage contract)"
        )


def inspect_component(name: str, directory: Path, pipeline: str | None) -> ComponentReport:
    """The report of one component directory."""
    report = ComponentReport(name, str(directory))
    try:
        config = _read_json(directory / "config.json")
    except ValueError as exc:
        report.problems.append(str(exc))
        return report
    report.class_name = config.get("_class_name")
    nvfp4, quant = _detect(report, directory, config)
    if quant is None:
        return report
    try:
        archive = read_archive(directory)
    except CheckpointError as exc:
        report.problems.append(str(exc))
        return report
    if not report.class_name:
        report.problems.append(f"{directory / 'config.json'}: no _class_name; cannot tell the model class")
        return report
    walk = _walk(report, pipeline, config, quant, archive)
    if walk is None:
        return report
    _check_names(report, quant, walk)
    declared = quant if report.method else None  # a BF16 checkpoint declares no config
    report.layers = _rows(walk, archive, declared, nvfp4)
    skipped = attribute(walk, archive)[1]
    if skipped:
        report.notes.append(
            f"{len(skipped)} tensor(s) feed no Linear and the model's loader skips them "
            f"(the engine logs a warning): {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}"
        )
    return report


def inspect_path(path: str | Path, component: str | None = None) -> InspectReport:
    """Inspect every transformer component of ``path`` (or only ``component``)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a directory")
    try:
        pipeline, components = find_components(path)
    except ValueError as exc:  # an unreadable model_index.json: nothing else can be inspected
        return InspectReport(str(path), errors=[str(exc)])
    if component is not None:
        known = [name for name, _ in components]
        components = [(name, d) for name, d in components if name == component]
        if not components:
            raise FileNotFoundError(f"{path}: no component {component!r}; found {', '.join(known) or 'none'}")
    report = InspectReport(str(path))
    for name, directory in components:
        logger.info("inspecting %s", directory)
        report.components.append(inspect_component(name, directory, pipeline))
    return report
