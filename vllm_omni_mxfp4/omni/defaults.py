"""Per-family BF16 defaults (:mod:`vllm_omni_mxfp4.config.defaults`) applied where vLLM-Omni builds
the transformer.

:func:`install` wraps the constructor of each class in ``FAMILY_DEFAULTS``: when it is given one of
our configs, online, with no ``ignored_layers`` (or with any config, for a ``required`` default),
the constructor gets a copy of that config carrying the family's default
(:attr:`MxQuantizationConfig.family_default`), whose ``get_quant_method`` keeps the default's
layers in BF16. One INFO line per build says which layers and why.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import logging
from typing import Any

from ..config.defaults import FAMILY_DEFAULTS, FamilyDefault
from .patching import wrap_once

logger = logging.getLogger(__name__)

_INSTALLED = "_vllm_omni_mxfp4_family_default"


def with_family_default(quant_config: Any, default: FamilyDefault) -> Any:
    """``quant_config`` with ``default`` attached, or ``quant_config`` itself when the default does
    not apply (not one of our configs; for a recipe's default, an offline checkpoint or a config
    with ``ignored_layers``)."""
    from .quant_config import MxQuantizationConfig

    if not isinstance(quant_config, MxQuantizationConfig):
        return quant_config
    config = quant_config.config
    if not default.required and (config.is_serialized or config.ignored_layers):
        return quant_config
    applied = copy.copy(quant_config)
    applied.family_default = default
    if default.required:
        logger.info(
            "vllm-omni-mxfp4: %s built with %s: Linears matching %s stay BF16 (%s)",
            default.class_name, config.METHOD, ", ".join(default.bf16), default.source,
        )  # fmt: skip
        return applied
    logger.info(
        "vllm-omni-mxfp4: %s built with %s and no ignored_layers: Linears matching %s stay BF16 "
        "(%s); give ignored_layers to choose the BF16 layers yourself",
        default.class_name,
        config.METHOD,
        ", ".join(default.bf16),
        default.source,
    )
    return applied


def _applying(original: Any, default: FamilyDefault) -> Any:
    signature = inspect.signature(original)

    def run(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if "quant_config" in bound.arguments:
            bound.arguments["quant_config"] = with_family_default(bound.arguments["quant_config"], default)
        return original(*bound.args, **bound.kwargs)

    return run


def install() -> None:
    """Wrap the constructor of every class with a family default; idempotent."""
    for default in FAMILY_DEFAULTS.values():
        cls = getattr(importlib.import_module(default.module), default.class_name)
        wrap_once(cls, "__init__", lambda original, default=default: _applying(original, default), _INSTALLED)
