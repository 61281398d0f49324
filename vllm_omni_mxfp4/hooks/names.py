"""Names in a quantization config checked against the model vLLM-Omni builds; per-component configs
spelled with method names accepted by vLLM-Omni's own factory.

- :func:`check_pipeline` runs where vLLM-Omni has built a pipeline (``initialize_model``, wrapped by
  :mod:`.build` for every family): each component built with one of our configs has every entry of
  every layer list and its leading-block count checked against the Linears it holds
  (:func:`check_built_model`). A typo in ``ignored_layers`` stops the engine before any weight loads.
- :func:`check_wan_components` / :func:`check_pipeline_experts`: the keys of a per-component config
  against the experts a Wan2.2 pipeline builds (``"transfomer"``, or ``transformer_2`` on a
  single-expert model, would leave an expert in BF16 silently). :func:`install` wraps
  ``resolve_wan_transformer_quant_config`` of the T2V/I2V and VACE pipelines; :mod:`.build` calls
  :func:`check_pipeline_experts` from its ``_create_transformer`` wrapper.
- ``factory._is_per_component_dict``: vLLM-Omni recognises a per-component dict only when one value
  is ``null`` or a dict, so ``{"transformer": "mxfp4", "transformer_2": "mxfp4_dualscale"}`` and
  ``{"default": "mxfp4"}`` (the user guide's forms) were refused as a flat config without a method.
  A dict without a method key whose values name one of our methods is per-component too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import SUPPORTED_METHODS, QuantConfig
from ..config.keys import METHOD_KEYS
from ..config.names import STORAGE_RULE, check_component_names, check_model_names, describe_accepted
from ..config.parse import parse_quantization
from ..models.build import non_linear_modules
from ..patching import wrap_once
from .checkpoint_dir import CheckpointDir

logger = logging.getLogger(__name__)

WAN_EXPERTS = ("transformer", "transformer_2")
"""The components vLLM-Omni's Wan2.2 pipelines build with a quantization config (its experts)."""

HOOK = "names"


def _our_configs(component: torch.nn.Module) -> list[Any]:
    """The distinct pure configs of our methods (quantized or BF16-routed) on ``component``'s Linears."""
    found: dict[int, Any] = {}
    for module in component.modules():
        method = getattr(module, "quant_method", None)
        config = getattr(method, "config", None) if getattr(method, "route", None) is not None else None
        if isinstance(config, QuantConfig):
            found.setdefault(id(config), config)
    return list(found.values())


def _linear_names(component: torch.nn.Module) -> tuple[set[str], set[str], list[str]]:
    """(every name a layer list may use: the prefix each vLLM Linear hands its quantization config,
    and the path of each plain ``nn.Linear``; those plain ones; pipeline-parallel slots not built)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.models.utils import PPMissingLayer

    names, plain, missing = set(), set(), []
    for name, module in component.named_modules():
        if isinstance(module, LinearBase):
            route = getattr(getattr(module, "quant_method", None), "route", None)
            names.add(
                route.prefix if route is not None and route.prefix else getattr(module, "prefix", "") or name
            )
        elif isinstance(module, torch.nn.Linear):
            # Plain nn.Linear layers (Wan's condition embedders, proj_out) run in BF16 whatever the
            # config says, so listing them (as merged checkpoints do) is not a typo.
            names.add(name)
            plain.add(name)
        elif isinstance(module, PPMissingLayer):
            missing.append(name)
    return names, plain, missing


def check_built_model(component: torch.nn.Module, name: str = "", directory: Path | None = None) -> None:
    """Check the layer lists and leading-block count of every one of our configs that built
    ``component`` (a transformer vLLM-Omni built; ``name`` its place in the pipeline) against it.

    ``directory``: the component's checkpoint directory, when local. Its files are checked against
    the model and the configs first (:mod:`.checkpoint_dir`: storage, block count, description), and
    the ``ignored_layers`` its ``config.json`` states are the checkpoint's storage contract, whose
    entries may name modules that are not Linears (:data:`~vllm_omni_mxfp4.config.names.STORAGE_RULE`);
    those are accepted and logged once."""
    configs = _our_configs(component)
    if not configs:
        return
    where = f" ({name})" if name else ""
    model = f"the {type(component).__name__}{where} vLLM-Omni built"
    checkpoint = CheckpointDir.read(directory) if directory is not None else None
    if checkpoint is not None:
        checkpoint.check(component, configs, model)
    linears, plain, missing = _linear_names(component)
    blocks = getattr(component, "blocks", None)
    num_blocks = len(blocks) if isinstance(blocks, torch.nn.ModuleList) else None
    modules, storage = non_linear_modules(component), checkpoint.contract if checkpoint else ()
    accepted: set[tuple[str, str]] = set()
    for config in configs:
        accepted.update(
            check_model_names(
                config, linears, num_blocks, model=model, unverifiable=missing, plain=plain,
                modules=modules, storage=storage,
            )
        )  # fmt: skip
    if accepted:
        logger.info(
            "%s: ignored_layers lists %d modules that are not Linears: %s. They have no quantization method "
            "and load as they are; accepted under the rule for %s.",
            name or type(component).__name__, len(accepted), describe_accepted(accepted), STORAGE_RULE,
        )  # fmt: skip


def check_pipeline(pipeline: torch.nn.Module, model_dir: str | Path | None = None) -> None:
    """:func:`check_built_model` on each component of a pipeline vLLM-Omni built (and on the model
    itself when it holds Linears directly); ``model_dir`` the pipeline's directory, when local
    (each component's checkpoint is its subdirectory)."""
    root = Path(model_dir) if isinstance(model_dir, (str, Path)) and Path(model_dir).is_dir() else None
    children = list(pipeline.named_children())
    for name, child in children:
        directory = root / name if root is not None and (root / name).is_dir() else None
        check_built_model(child, name, directory)
    if not children:
        check_built_model(pipeline, directory=root)


def check_wan_components(quant_config: Any, experts: tuple[str, ...] = WAN_EXPERTS, where: str = "") -> None:
    """Refuse per-component keys that name no Wan2.2 expert of ``experts`` (when one of our methods is
    involved); ``where`` says which pipeline, for the message."""
    from vllm_omni.quantization.component_config import ComponentQuantizationConfig

    from ..omni.quant_config import MxQuantizationConfig

    if not isinstance(quant_config, ComponentQuantizationConfig):
        return
    configs = [*quant_config.component_configs.values(), quant_config.default_config]
    if any(isinstance(c, MxQuantizationConfig) for c in configs):
        check_component_names(quant_config.component_configs, experts, f" in the per-component config{where}")


def check_pipeline_experts(pipeline: Any) -> None:
    """Refuse per-component keys naming an expert this Wan pipeline does not have (``transformer_2``
    on a single-expert model such as TI2V-5B): that config would silently configure nothing."""
    od_config = pipeline.od_config
    if getattr(od_config, "quantization_config_is_auto_detected", False):
        return
    experts = (
        ("transformer", "transformer_2")
        if getattr(pipeline, "has_transformer_2", False)
        else ("transformer",)
    )
    where = f" (the model {od_config.model!r} has {' and '.join(experts)} only)" if len(experts) == 1 else ""
    check_wan_components(getattr(od_config, "quantization_config", None), experts, where)


def _names_our_method(value: object) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in SUPPORTED_METHODS
    if isinstance(value, Mapping):
        return any(_names_our_method(value.get(k)) for k in METHOD_KEYS)
    return False


def _names_another_upstream_method(value: object) -> bool:
    """Whether ``value`` (a component's method name or dict) names a method vLLM-Omni serves itself
    (``fp8``, ...): such a component is vLLM-Omni's to parse, next to ours."""
    from vllm_omni.quantization.factory import SUPPORTED_QUANTIZATION_METHODS

    method = value if isinstance(value, str) else None
    if isinstance(value, Mapping):
        method = next((value[k] for k in METHOD_KEYS if isinstance(value.get(k), str)), None)
    if method is None or _names_our_method(method):
        return False
    return method.strip().lower() in SUPPORTED_QUANTIZATION_METHODS


def _mentions_our_method(spec: Mapping[Any, Any]) -> bool:
    """Whether a value of ``spec``, or of a dict nested in it, names ``mxfp4`` / ``mxfp4_dualscale``."""
    return any(
        _names_our_method(v) or (isinstance(v, Mapping) and _mentions_our_method(v)) for v in spec.values()
    )


def is_our_per_component_dict(spec: Mapping[str, Any]) -> bool:
    """A dict without a method key whose values are method names, dicts or ``null``, one of which
    names ``mxfp4`` / ``mxfp4_dualscale``: per-component, whatever vLLM-Omni's own test says."""
    if not spec or any(k in spec for k in METHOD_KEYS):
        return False
    if not all(v is None or isinstance(v, (str, Mapping)) for v in spec.values()):
        return False
    return any(_names_our_method(v) for v in spec.values())


def _accepting_our_dicts(original: Any) -> Any:
    """vLLM-Omni's per-component test, plus ours; a dict without a method key that names one of our
    methods anywhere is parsed by :func:`~vllm_omni_mxfp4.config.parse.parse_quantization` first, so
    that a bad entry (a nested, integer or empty value, keys without a method, a non-string or empty
    component name) is refused naming the component and the key, not with vLLM-Omni's generic
    "Dict quantization config must have a 'method' ..." or Python's "keywords must be strings"."""

    def run(spec: Any) -> bool:
        if (
            isinstance(spec, Mapping)
            and not any(k in spec for k in METHOD_KEYS)
            and _mentions_our_method(spec)
        ):
            # raises with the component and key named; another method of vLLM-Omni's is its to check
            parse_quantization({k: v for k, v in spec.items() if not _names_another_upstream_method(v)})
        return original(spec) or is_our_per_component_dict(spec)

    return run


def _checking_resolve(original: Any) -> Any:
    def run(config, quant_config, component):
        check_wan_components(quant_config)
        return original(config, quant_config, component)

    return run


def install() -> None:
    """Wrap vLLM-Omni's Wan per-component resolution and its factory (module docstring); idempotent."""
    from vllm_omni.diffusion.models.wan2_2 import pipeline_wan2_2, pipeline_wan2_2_vace
    from vllm_omni.quantization import factory

    for pipeline in (pipeline_wan2_2, pipeline_wan2_2_vace):  # each imported the function by name
        wrap_once(pipeline, "resolve_wan_transformer_quant_config", _checking_resolve, HOOK)
    wrap_once(factory, "_is_per_component_dict", _accepting_our_dicts, HOOK)
