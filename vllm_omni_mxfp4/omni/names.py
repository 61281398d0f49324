"""Names in a quantization config checked where vLLM-Omni builds the model; per-component configs
spelled with method names accepted by vLLM-Omni's own factory.

:func:`install` (called by :func:`vllm_omni_mxfp4.omni.plugin.register` in every vLLM-Omni process)
wraps these functions of vLLM-Omni:

- ``WanTransformer3DModel._validate_w4a8_fallback_layers``, which vLLM-Omni's Wan2.2 transformer
  calls with its quantization config at the end of its constructor, when every Linear exists and
  has had its ``get_quant_method``: with one of our configs, every layer list and the leading-block
  count are checked against the built model first (:func:`check_built_model`), then vLLM-Omni's
  own check runs. VACE's transformer builds more Linears after that call: its constructor is
  wrapped to run the same check once they exist.
- ``resolve_wan_transformer_quant_config`` of the T2V/I2V and VACE pipelines, which selects each
  Wan expert's config from a per-component config: a key that names no Wan expert
  (``"transfomer"``) is an error there, instead of leaving that expert in BF16.
- ``_create_transformer`` of the T2V, I2V and VACE pipelines: a key naming an
  expert the pipeline does not have (``transformer_2`` on a single-expert model) is an error.
- ``factory._is_per_component_dict``: vLLM-Omni recognises a per-component dict only when one value
  is ``null`` or a dict, so ``{"transformer": "mxfp4", "transformer_2": "mxfp4_dualscale"}`` and
  ``{"default": "mxfp4"}`` (the user guide's forms) were refused as a flat config without a method.
  A dict without a method key whose values name one of our methods is per-component too.

:func:`engine_quant_config` is the engine's own build of a ``quantization_config`` value, for
callers (the text-to-video example) that must accept exactly what the engine accepts.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..config import SUPPORTED_METHODS
from ..config.keys import METHOD_KEYS
from ..config.names import check_component_names, check_model_names
from .patching import wrap_once

logger = logging.getLogger(__name__)

WAN_EXPERTS = ("transformer", "transformer_2")
"""The components vLLM-Omni's Wan2.2 pipelines build with a quantization config (its experts)."""

_INSTALLED = "_vllm_omni_mxfp4_names"

_CALLER_CHECKS = contextvars.ContextVar("vllm_omni_mxfp4_caller_checks_names", default=False)


@contextlib.contextmanager
def names_checked_by_caller() -> Iterator[None]:
    """Within this context a model build skips :func:`check_built_model`: for a caller that checks
    the layer lists itself and reports every problem (``vllm-omni-mxfp4 inspect``) instead of
    having the first one refuse the build. Whether the wrappers are installed (the plugin loaded
    earlier in the process) then makes no difference to what such a caller sees."""
    token = _CALLER_CHECKS.set(True)
    try:
        yield
    finally:
        _CALLER_CHECKS.reset(token)


def check_built_model(model: torch.nn.Module, quant_config: Any) -> None:
    """Check one of our configs' layer lists and leading-block count against ``model``, built."""
    if _CALLER_CHECKS.get():
        return
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.models.utils import PPMissingLayer

    from .quant_config import MxQuantizationConfig

    if not isinstance(quant_config, MxQuantizationConfig):
        return
    modules = dict(model.named_modules())
    # Plain nn.Linear layers (Wan's condition embedders, proj_out) are Linears of the model too: they
    # run in BF16 whatever the config says, so listing them (as merged checkpoints do) is not a typo.
    linears = {name for name, module in modules.items() if isinstance(module, (LinearBase, torch.nn.Linear))}
    plain = {name for name in linears if not isinstance(modules[name], LinearBase)}
    missing = [name for name, module in modules.items() if isinstance(module, PPMissingLayer)]
    blocks = getattr(model, "blocks", None)
    num_blocks = len(blocks) if isinstance(blocks, torch.nn.ModuleList) else None
    check_model_names(
        quant_config.config,
        linears,
        num_blocks,
        model=f"the {type(model).__name__} vLLM-Omni built",
        unverifiable=missing,
        plain=plain,
    )


def check_wan_components(quant_config: Any, experts: tuple[str, ...] = WAN_EXPERTS, where: str = "") -> None:
    """Refuse per-component keys that name no Wan2.2 expert of ``experts`` (when one of our methods is
    involved); ``where`` says which pipeline, for the message."""
    from vllm_omni.quantization.component_config import ComponentQuantizationConfig

    from .quant_config import MxQuantizationConfig

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


def is_our_per_component_dict(spec: Mapping[str, Any]) -> bool:
    """A dict without a method key whose values are method names, dicts or ``null``, one of which
    names ``mxfp4`` / ``mxfp4_dualscale``: per-component, whatever vLLM-Omni's own test says."""
    if not spec or any(k in spec for k in METHOD_KEYS):
        return False
    if not all(v is None or isinstance(v, (str, Mapping)) for v in spec.values()):
        return False
    return any(_names_our_method(v) for v in spec.values())


def engine_quant_config(spec: Any) -> Any:
    """What the engine builds from ``quantization_config=spec``: vLLM-Omni's factory with this
    package registered. Raises the engine's error for a spec the engine refuses."""
    from vllm_omni.quantization.factory import build_quant_config

    from .plugin import register

    register()
    return build_quant_config(spec)


def _wrap(owner: Any, name: str, make: Any) -> None:
    """:func:`~.patching.wrap_once` with this module's marker."""
    wrap_once(owner, name, make, _INSTALLED)


def _checking_validate(original: Any, wan: type) -> Any:
    def run(self, quant_config):
        # A subclass (VACE) adds Linears after this call: only the plain transformer is complete.
        if type(self) is wan:
            check_built_model(self, quant_config)
        return original(self, quant_config)

    return run


def _checking_vace_init(original: Any) -> Any:
    def run(self, *args, quant_config=None, **kwargs):
        original(self, *args, quant_config=quant_config, **kwargs)
        check_built_model(self, quant_config)  # now with the VACE blocks it builds after Wan's

    return run


def _checking_resolve(original: Any) -> Any:
    def run(config, quant_config, component):
        check_wan_components(quant_config)
        return original(config, quant_config, component)

    return run


def _checking_create(original: Any) -> Any:
    def run(self, config, component="transformer"):
        check_pipeline_experts(self)
        return original(self, config, component)

    return run


def _accepting_our_dicts(original: Any) -> Any:
    return lambda spec: original(spec) or is_our_per_component_dict(spec)


def install() -> None:
    """Wrap vLLM-Omni's model construction and factory (see the module docstring); idempotent."""
    from vllm_omni.diffusion.models.wan2_2 import (
        pipeline_wan2_2,
        pipeline_wan2_2_i2v,
        pipeline_wan2_2_vace,
        wan2_2_transformer,
        wan2_2_vace_transformer,
    )
    from vllm_omni.quantization import factory

    wan = wan2_2_transformer.WanTransformer3DModel
    _wrap(wan, "_validate_w4a8_fallback_layers", lambda original: _checking_validate(original, wan))
    _wrap(wan2_2_vace_transformer.WanVACETransformer3DModel, "__init__", _checking_vace_init)
    for pipeline in (pipeline_wan2_2, pipeline_wan2_2_vace):  # each imported the function by name
        _wrap(pipeline, "resolve_wan_transformer_quant_config", _checking_resolve)
    pipelines = (
        pipeline_wan2_2.Wan22Pipeline,
        pipeline_wan2_2_i2v.Wan22I2VPipeline,
        pipeline_wan2_2_vace.Wan22VACEPipeline,
    )
    for pipeline_class in pipelines:  # each defines its own _create_transformer
        _wrap(pipeline_class, "_create_transformer", _checking_create)
    _wrap(factory, "_is_per_component_dict", _accepting_our_dicts)
    logger.debug("vllm-omni-mxfp4: config names are checked where vLLM-Omni builds Wan2.2 experts")
