"""The model walk of ``inspect``: a component's class built on the meta device with the config the
engine would give it, and every checkpoint tensor traced through the class's own loader.

The build and the trace are :mod:`vllm_omni_mxfp4.models.build`'s; here the config is the one the
engine would build the class with: the checkpoint's (or online ``mxfp4``) on the emulated kernels
(what is inspected is backend-independent), with the class's family default attached as the
plugin attaches it where vLLM-Omni builds the class. Nothing here checks layer names: the walk is a
direct build, not vLLM-Omni's ``initialize_model``, so every problem is reported by the caller
instead of the first one refusing the build. Imports torch and vLLM (through the build), lazily.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..config import QuantConfig
from ..models.records import ModelWalk


def walk_model(
    class_name: str,
    pipeline: str | None,
    config: Mapping[str, Any],
    quant: QuantConfig | None,
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
) -> ModelWalk:
    """Build ``class_name`` on the meta device with ``quant`` and trace where ``tensors`` go."""
    from ..models.build import (
        build_on_meta,
        find_transformer_class,
        non_linear_modules,
        runtime_linears,
        trace_loading,
        world_of_one,
    )
    from ..omni import build_quant_config
    from ..omni.routes import family_default_of, with_family_default

    cls = find_transformer_class(class_name, pipeline)
    quant_config = None
    if quant is not None:
        quant_config = build_quant_config(replace(quant, backend="emulated"))
        default = family_default_of(cls)
        if default is not None:
            quant_config = with_family_default(quant_config, default)
    with world_of_one() as od_config:
        model = build_on_meta(cls, config, quant_config, od_config)
        walk = ModelWalk(class_name, cls.__module__, runtime_linears(model))
        walk.packed = {k: list(v) for k, v in dict(getattr(model, "packed_modules_mapping", {})).items()}
        walk.placements = trace_loading(model, tensors)
        walk.modules = non_linear_modules(model)
    return walk
