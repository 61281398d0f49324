"""Per-family BF16 defaults (:mod:`vllm_omni_mxfp4.config.defaults`) applied where vLLM-Omni builds
the transformer.

:func:`install` wraps the constructor of each class in ``FAMILY_DEFAULTS``: when it is given one of
our configs, online, with no ``ignored_layers`` (or with any config, for a ``required`` default),
the constructor gets a copy of that config carrying the family's default as a route override
(:func:`vllm_omni_mxfp4.omni.routes.with_family_default`), whose ``get_quant_method`` keeps the
default's layers in BF16. One INFO line per build says which layers and why.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from ..config.defaults import FAMILY_DEFAULTS, FamilyDefault
from ..omni.routes import with_family_default
from ..patching import wrap_once


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
        wrap_once(
            cls, "__init__", lambda original, default=default: _applying(original, default), "family_defaults"
        )
