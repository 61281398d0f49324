"""Serving an NVFP4 checkpoint with ``mxfp4``: requantization while the weights load.

When a transformer (a Wan expert, ``transformer`` / ``transformer_2``, or any other pipeline's
``transformer``) is built with one of our configs and its directory holds an NVFP4 checkpoint
(:func:`~vllm_omni_mxfp4.sources.nvfp4.detect_nvfp4`: every producer form, failing closed with the
layer named), three things change (docs/nvfp4.md, "Serving an NVFP4 checkpoint"):

1. **Build** (:mod:`.build` wraps the Wan pipelines' ``_create_transformer`` and, for every other
   pipeline, vLLM-Omni's ``initialize_model``, whose layer names come from the class itself,
   :func:`_class_names`): the producer's ``quantization_config`` is set aside (vLLM-Omni would refuse
   it as another method), and the expert is built with a copy of the user's config carrying its
   :class:`Nvfp4Plan` as a route override (:func:`serving`): a Linear whose checkpoint layers are
   NVFP4 gets the offline ``mxfp4`` method (the runtime config with serialized weights,
   :func:`~vllm_omni_mxfp4.config.reconcile.nvfp4_source_config`); one whose layers are stored
   unquantized or FP8 gets BF16; ``W4A16_NVFP4`` layers run W4A8.
2. **Load** (:func:`convert_stream`, applied by :func:`~.loading.guarded_load_weights` to the
   checkpoint's tensor stream): each NVFP4 layer's tensors are staged until its last one arrives,
   then normalised (:func:`~vllm_omni_mxfp4.sources.nvfp4.load_nvfp4_weight`: nibble order, swizzled
   scales, global scale), requantized on the target device (:func:`~vllm_omni_mxfp4.formats.requant.requantize_nvfp4`)
   and handed on as the packed ``weight`` and E8M0 ``weight_scale`` the offline method loads, so every
   backend and TP sharding run unchanged: each rank receives whole tensors and shards the MXFP4
   result, so swizzled scales are unswizzled before any sharding. Layers that run in BF16 get the
   exact float32 dequant rounded once to BF16; ``input_scale`` (static activation scales) is dropped,
   since activations are quantized dynamically.
3. **Report**: one record per checkpoint layer (requantized with its rule, error and precision,
   dequantized, kept as stored and why) on the expert (``_mx_nvfp4``), logged and read by :mod:`.report`.

Fused Q/K/V parts are requantized one by one: MXFP4 blocks run along K within a row, so joining the
parts' rows first would give the same bytes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import spec
from ..config import LayerRoute, Precision
from ..config.methods import Mxfp4Config
from ..config.reconcile import nvfp4_source_config
from ..errors import CheckpointError
from ..kernels.requant import requantize_nvfp4
from ..models.wan import runtime_layer_name
from ..omni.routes import with_override
from ..patching import wrap_once
from ..sources.nvfp4 import (
    LayerSource,
    Nvfp4Checkpoint,
    SourceError,
    detect_nvfp4,
    load_mul_scale,
    load_nvfp4_weight,
    original_tensors,
    parse_quant_config,
    read_checkpoint_headers,
)
from ..sources.nvfp4.dequant import dequantize_layer
from ..sources.nvfp4.routing import decide_linear

logger = logging.getLogger(__name__)

PLAN_ATTR = "_mx_nvfp4"
"""The attribute of a built expert holding its :class:`Nvfp4Plan` (and so its load report)."""

AUTO_RULE = spec.REQUANT_DEFAULT_RULE
"""What ``nvfp4_requant_rule: auto`` means on every backend. Requantized weights are data to each
kernel (packed E2M1 + E8M0, prepared like any offline checkpoint): no kernel's ``can_implement``
looks at how the weight exponents were chosen, so the most accurate rule always runs."""


def runtime_name(layer: str) -> str:
    """The runtime Linear path of a checkpoint layer (Wan2.2's fused Q/K/V and FFN names), else itself."""
    try:
        return runtime_layer_name(layer)
    except CheckpointError:
        return layer


def _wan_names(layer: str) -> tuple[str, str]:
    """(runtime prefix, module path) of a Wan2.2 checkpoint layer: both its fused runtime name."""
    name = runtime_name(layer)
    return name, name


def _class_names(
    od_config: Any, directory: Path, checkpoint: Nvfp4Checkpoint
) -> Callable[[str], tuple[str, str]]:
    """(runtime prefix, module path) of each checkpoint layer of any other pipeline's transformer,
    from vLLM-Omni's class itself (:func:`~vllm_omni_mxfp4.models.derive_names`, in a child process:
    the engine's own distributed state is not touched; cached on disk after the first time). A
    tensor the class does not load, or an NVFP4 / FP8 layer it has no Linear for, is refused."""
    from ..errors import read_json_object
    from ..models import derive_names
    from ..models.names import names_of_class

    config = read_json_object(
        directory / "config.json", if_missing="a diffusers transformer needs its config.json"
    )
    tensors, _, _ = read_checkpoint_headers(directory)
    original = original_tensors(tensors, checkpoint.layers)
    names = names_of_class(
        directory, config, original, derive_names, getattr(od_config, "model_class_name", None)
    )

    def of(layer: str) -> tuple[str, str]:
        if names.is_linear(layer):
            return names.runtime_layer_name(layer), names.runtime_module(layer)
        if checkpoint.layers[layer].action != "keep":
            raise SourceError(
                layer,
                f"vLLM-Omni's {names.model_class} loads this {checkpoint.layers[layer].algo} layer into no Linear",
                "the checkpoint was made for another model class; check config.json's _class_name",
            )
        return layer, layer  # a kept non-Linear (a norm): streamed as stored

    return of


@dataclass
class Nvfp4Plan:
    """One expert's NVFP4 checkpoint and what happens to each of its layers.

    ``config``: the offline ``mxfp4`` config its quantized Linears get; ``rule``: the requantization
    rule (``auto`` resolved); ``params``: checkpoint module -> its tensor names in the files, so a
    layer is converted once all of them arrived; ``runtime`` / ``modules``: checkpoint layer -> the
    prefix its runtime Linear's quantization config sees / that Linear's module path (Wan's fixed
    names, or those derived from any other class, :func:`_class_names`); ``by_runtime``: runtime
    prefix -> its checkpoint layers; ``mx_layers``: runtime prefixes built with the ``mxfp4`` method;
    ``records``: the load report.
    """

    component: str
    directory: Path
    checkpoint: Nvfp4Checkpoint
    config: Mxfp4Config
    rule: str
    params: Mapping[str, frozenset[str]]
    runtime: Mapping[str, str]
    modules: Mapping[str, str]
    by_runtime: Mapping[str, tuple[str, ...]]
    mx_layers: set[str] = field(default_factory=set)
    records: list[dict[str, Any]] = field(default_factory=list)
    #: The user's vLLM config for this component, which the expert is built with (plus this plan).
    quant_config: Any = None

    @classmethod
    def of(
        cls,
        component: str,
        directory: Path,
        checkpoint: Nvfp4Checkpoint,
        config: Mxfp4Config,
        names: Callable[[str], tuple[str, str]] | None = None,
    ) -> Nvfp4Plan:
        """The plan of ``checkpoint`` (detected in ``directory``) served with ``config``; ``names``
        gives a checkpoint layer's (runtime prefix, module path), Wan2.2's fixed names by default."""
        tensors, _, _ = read_checkpoint_headers(directory)
        params: dict[str, set[str]] = {}
        for key in tensors:
            module, _, param = key.rpartition(".")
            params.setdefault(module, set()).add(param)
        named = {name: (names or _wan_names)(name) for name in checkpoint.layers}
        by_runtime: dict[str, list[str]] = {}
        for name, (prefix, _) in named.items():
            by_runtime.setdefault(prefix, []).append(name)
        rule = AUTO_RULE if config.nvfp4_requant_rule == "auto" else config.nvfp4_requant_rule
        return cls(
            component, directory, checkpoint, config, rule,
            {m: frozenset(p) for m, p in params.items() if m in checkpoint.layers},
            {n: prefix for n, (prefix, _) in named.items()}, {n: module for n, (_, module) in named.items()},
            {r: tuple(sorted(n)) for r, n in by_runtime.items()},
        )  # fmt: skip

    def route(self, prefix: str, route: LayerRoute) -> LayerRoute:
        """The route of the runtime Linear ``prefix`` given the config's ``route``: the shared NVFP4
        decision (:func:`~vllm_omni_mxfp4.sources.nvfp4.routing.decide_linear`: BF16 when its
        checkpoint layers are not all NVFP4, W4A8 for ``W4A16_NVFP4`` layers), else ``route``."""
        layers = [self.checkpoint.layers[n] for n in self.by_runtime.get(prefix, ())]
        if not layers:
            return route  # no tensors in the checkpoint: as any offline layer (the load says so)
        decision = decide_linear(layers, quantizable=True, runtime=prefix)
        if not decision.quantized:
            subject = f"{layers[0].name} " if len(layers) == 1 else ""
            return LayerRoute(Precision.BF16, (), f"NVFP4 checkpoint: {subject}{decision.reason}", prefix)
        if route.precision is Precision.BF16:
            return route
        if route.precision is Precision.W4A4 and decision.precision == "w4a8":
            route = LayerRoute(Precision.W4A8, (), decision.reason, prefix)
        self.mx_layers.add(prefix)
        return route

    def override(self, prefix: str, route: LayerRoute, config: Any) -> tuple[LayerRoute, Mxfp4Config]:
        """This plan as a route override (:mod:`vllm_omni_mxfp4.omni.routes`): :meth:`route`, and the
        offline config every Linear of the expert gets (its weights arrive serialized)."""
        return self.route(prefix, route), self.config

    def summary(self) -> str:
        """One line: how many checkpoint layers were requantized, dequantized and kept."""
        counts: dict[str, int] = {}
        for record in self.records:
            counts[record["action"]] = counts.get(record["action"], 0) + 1
        done = ", ".join(f"{n} {a}" for a, n in sorted(counts.items()))
        worst = max((r for r in self.records if "rel_rms" in r), key=lambda r: r["rel_rms"], default=None)
        tail = f"; largest rel_rms {worst['rel_rms']:.4g} ({worst['layer']})" if worst else ""
        return f"{self.component}: {self.checkpoint.summary()}; loaded: {done} (rule {self.rule}){tail}"


# ------------------------------------------------------------------------------- detection


def _runtime_config(od_config: Any, component: str) -> Any:
    """The quantization config the user gave for ``component`` (None when auto-detected or absent)."""
    from vllm_omni.quantization.component_config import ComponentQuantizationConfig

    if getattr(od_config, "quantization_config_is_auto_detected", False):
        return None
    qc = getattr(od_config, "quantization_config", None)
    if isinstance(qc, ComponentQuantizationConfig):
        qc = qc.component_configs.get(component, qc.default_config)
    return qc


def plan_nvfp4_expert(od_config: Any, component: str, derived: bool = False) -> Nvfp4Plan | None:
    """The :class:`Nvfp4Plan` of ``component`` when one of our configs loads an NVFP4 checkpoint from
    a local directory; None otherwise. ``derived``: the layer names come from the pipeline's own
    transformer class (:func:`_class_names`), not Wan2.2's. Raises :class:`SourceError` for a layer we
    would not reproduce exactly, ValueError for ``mxfp4_dualscale``."""
    from ..omni.quant_config import MxQuantizationConfig

    runtime = _runtime_config(od_config, component)
    model = getattr(od_config, "model", None)
    if not isinstance(runtime, MxQuantizationConfig) or not isinstance(model, str):
        return None
    directory = Path(model) / component
    if not directory.is_dir():
        return None
    checkpoint = detect_nvfp4(directory)
    if checkpoint is None:
        return None
    config = nvfp4_source_config(runtime.config, f"{component} ({checkpoint.origin})")
    names = _class_names(od_config, directory, checkpoint) if derived else None
    plan = Nvfp4Plan.of(component, directory, checkpoint, config, names)
    plan.quant_config = runtime
    logger.info("%s: %s; requantizing to MXFP4 at load (rule %s)", component, checkpoint.summary(), plan.rule)
    return plan


@contextlib.contextmanager
def serving(od_config: Any, plan: Nvfp4Plan) -> Iterator[None]:
    """``od_config.quantization_config`` with the plan's component built under the plan for the
    duration of the build: its config (the whole config, or its entry of a per-component config)
    replaced by a copy carrying the plan as a route override. The build is single-threaded."""
    from vllm_omni.quantization.component_config import ComponentQuantizationConfig

    saved = od_config.quantization_config
    planned = with_override(plan.quant_config, plan)
    if isinstance(saved, ComponentQuantizationConfig):  # its entries are read-only: a new one
        replaced = ComponentQuantizationConfig(
            {**saved.component_configs, plan.component: planned}, saved.default_config
        )
    else:
        replaced = planned
    od_config.quantization_config = replaced
    try:
        yield
    finally:
        od_config.quantization_config = saved


def attach(module: Any, plan: Nvfp4Plan) -> None:
    """Record ``plan`` on the expert built under it (:data:`PLAN_ATTR`), where the load finds it."""
    if not isinstance(module, torch.nn.Module):
        raise SourceError(
            plan.component,
            f"the pipeline has no {plan.component} module to load the NVFP4 checkpoint into",
            "serve this pipeline from a converted checkpoint (vllm-omni-mxfp4 convert)",
        )
    setattr(module, PLAN_ATTR, plan)


def _tolerant_from_dict(original: Callable) -> Callable:
    """``TransformerConfig.from_dict`` that keeps an NVFP4 producer config it cannot build as a method
    name without a config (vLLM-Omni 0.30 fails at start-up on compressed-tensors, which it looks up as
    ``compressed_tensors``, and on ModelOpt ``W4A16_NVFP4``, which it hands to its FP8 config): the
    expert's build reads it (:func:`plan_nvfp4_expert`) or fails there."""

    def run(cls: type, data: dict) -> Any:
        try:
            return original(cls, data)
        except (ValueError, TypeError) as exc:
            qc = data.get("quantization_config") if isinstance(data, dict) else None
            if not isinstance(qc, dict) or parse_quant_config(qc, "config.json quantization_config") is None:
                raise
            logger.info("NVFP4 checkpoint: vLLM-Omni cannot build its quantization_config (%s); "
                        "vllm-omni-mxfp4 reads it when the transformer is built with mxfp4", exc)  # fmt: skip
            return cls(params=dict(data), quant_method=qc.get("quant_method"), quant_config=None)

    return run


def install() -> None:
    """Wrap ``TransformerConfig.from_dict`` (:func:`_tolerant_from_dict`); idempotent. The builds are
    wrapped by :mod:`.build`."""
    from vllm_omni.diffusion import data

    wrap_once(data.TransformerConfig, "from_dict", _tolerant_from_dict, "nvfp4_config")


# ------------------------------------------------------------------------------- conversion


def _target(model: torch.nn.Module, prefix: str, plan: Nvfp4Plan, name: str) -> torch.nn.Module | None:
    """The runtime module of checkpoint layer ``name`` under ``prefix`` (``transformer.``), if any."""
    try:
        return model.get_submodule(prefix + plan.modules[name])
    except AttributeError:
        return None


def _float_dtype(module: torch.nn.Module | None) -> tuple[torch.dtype, torch.device]:
    """The dtype and device a BF16 layer's weight has in ``module`` (bfloat16 / CPU without one)."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.dtype, weight.device
    return torch.bfloat16, torch.device("cpu")


def _record(plan: Nvfp4Plan, layer: LayerSource, action: str, reason: str, **extra: Any) -> None:
    """Add one layer's entry to the expert's load report (read by :mod:`.report`) and log it."""
    record = {"layer": layer.name, "runtime": plan.runtime[layer.name], "action": action, "algo": layer.algo}
    record.update(reason=reason, **extra)
    plan.records.append(record)
    logger.info("%s.%s: %s (%s)", plan.component, layer.name, action, reason)


def convert_layer(
    plan: Nvfp4Plan, layer: LayerSource, staged: Mapping[str, torch.Tensor], module: torch.nn.Module | None
) -> list[tuple[str, torch.Tensor]]:
    """The tensors a completely staged checkpoint layer becomes for the runtime ``module``: MXFP4
    ``weight`` / ``weight_scale`` (+ ``mul_scale``) for an ``mxfp4`` Linear, a BF16 ``weight``
    otherwise; ``bias`` as stored; static activation scales dropped."""
    mx = layer.action == "requantize" and plan.runtime[layer.name] in plan.mx_layers
    dtype, device = _float_dtype(module)
    if mx:
        device = module.weight.device  # the offline layer's packed weight: requantize where it lives

    def get(key: str) -> torch.Tensor:
        return staged[key].to(device)

    out = [(layer.tensors["bias"], staged[layer.tensors["bias"]])] if "bias" in layer.tensors else []
    weight_key = layer.tensors["weight"]
    module_name = weight_key.rpartition(".")[0]
    if not mx:
        out.append((f"{module_name}.weight", dequantize_layer(layer, get, dtype, device)))
        why = layer.reason if layer.action == "dequantize" else "NVFP4 layer of a Linear that runs in BF16"
        _record(plan, layer, "dequantize", f"{why}; exact float32 dequant rounded once to {dtype}")
        return out
    result = requantize_nvfp4(load_nvfp4_weight(layer, get), plan.rule)
    out += [(f"{module_name}.weight", result.data), (f"{module_name}.weight_scale", result.scale)]
    smooth = load_mul_scale(layer, get)
    if smooth is not None:
        out.append((f"{module_name}.mul_scale", smooth))
    e, route = result.error, module.quant_method.route
    _record(
        plan, layer, "requantize", f"{layer.algo} -> MXFP4, {route.precision.value.upper()} ({route.reason})",
        rule=e.rule, rel_rms=e.rel_rms, max_abs=e.max_abs, exact_blocks=e.exact_blocks,
        total_blocks=e.total_blocks, precision=route.precision.value,
    )  # fmt: skip
    return out


def _plans(model: torch.nn.Module) -> dict[str, Nvfp4Plan]:
    """Tensor-name prefix -> plan, for the model itself and each of its children built under one."""
    found = {"": getattr(model, PLAN_ATTR)} if isinstance(getattr(model, PLAN_ATTR, None), Nvfp4Plan) else {}
    for name, child in model.named_children():
        plan = getattr(child, PLAN_ATTR, None)
        if isinstance(plan, Nvfp4Plan):
            found[f"{name}."] = plan
    return found


def convert_stream(
    model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterable[tuple[str, torch.Tensor]]:
    """``weights`` with every NVFP4 / FP8 layer of an NVFP4 expert of ``model`` converted (module
    docstring, step 2); unchanged when ``model`` has none."""
    plans = _plans(model)
    return _converted(model, plans, weights) if plans else weights


def _converted(
    model: torch.nn.Module, plans: Mapping[str, Nvfp4Plan], weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The generator behind :func:`convert_stream`: stage, convert when complete, check the end."""
    staged: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    prefixes = sorted(plans, key=len, reverse=True)  # "" (the model itself) last
    for name, tensor in weights:
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        plan = plans.get(prefix) if prefix is not None else None
        key = name[len(prefix) :] if plan is not None else name
        layer = plan.checkpoint.layers.get(key.rpartition(".")[0]) if plan is not None else None
        if layer is None or layer.action == "keep":
            if layer is not None and key == layer.tensors.get("weight"):
                _record(plan, layer, "keep", f"{layer.reason}; loaded as stored")
            yield name, tensor
            continue
        module = key.rpartition(".")[0]
        stage = staged.setdefault((prefix, module), {})
        stage[key] = tensor
        if len(stage) < len(plan.params[module]):
            continue
        del staged[(prefix, module)]
        for out_key, out in convert_layer(plan, layer, stage, _target(model, prefix, plan, module)):
            yield prefix + out_key, out
        stage.clear()  # the staged NVFP4 tensors go before the next layer arrives
    _check_finished(plans, staged)


def _check_finished(plans: Mapping[str, Nvfp4Plan], staged: Mapping[tuple[str, str], Mapping]) -> None:
    """Refuse a stream that ended with a layer's tensors missing; log each expert's summary."""
    for (prefix, module), stage in staged.items():
        plan = plans[prefix]
        missing = sorted(plan.params[module] - {k.rpartition(".")[2] for k in stage})
        raise SourceError(
            f"{plan.component}.{module}",
            f"the checkpoint's weight stream ended without its {missing} (the headers of {plan.directory} list them)",
            "the files changed while loading, or a shard is missing; check the directory",
        )
    for plan in plans.values():
        logger.info("%s", plan.summary())
