"""Route overrides: how a Linear's route changes for reasons outside the user's config.

A quantization config routes each Linear by its own keys (:meth:`~vllm_omni_mxfp4.config.methods.MethodConfig.route`).
Two things the config cannot know change that route where the model is built:

- a model family's BF16 default (:class:`~vllm_omni_mxfp4.config.defaults.FamilyDefault`: layers a
  published MXFP4 recipe keeps in BF16, or that the model's code cannot run packed);
- an NVFP4 checkpoint being served with ``mxfp4`` (the hooks' ``Nvfp4Plan``: a layer stored NVFP4 is
  requantized and served offline, one stored unquantized runs in BF16).

Both are a :class:`~vllm_omni_mxfp4.config.methods.RouteOverride` attached to a copy of the vLLM
config (:func:`with_override`) by the code that builds the model; :meth:`MxQuantizationConfig.get_quant_method` applies the overrides
in the order they were attached. Nothing is read from a global: the config a class is built with
says everything about how its Linears run.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

from ..config.defaults import FAMILY_DEFAULTS, FamilyDefault
from ..config.methods import RouteOverride

if TYPE_CHECKING:
    from .quant_config import MxQuantizationConfig

logger = logging.getLogger(__name__)


def with_override(quant_config: MxQuantizationConfig, override: RouteOverride) -> MxQuantizationConfig:
    """A shallow copy of ``quant_config`` that also applies ``override`` (after its own overrides);
    the original, which other components may share, is left as it is."""
    applied = copy.copy(quant_config)
    applied.overrides = (*quant_config.overrides, override)
    return applied


def overrides_of(quant_config: MxQuantizationConfig, kind: type) -> list:
    """The overrides of ``quant_config`` that are instances of ``kind``, in order."""
    return [o for o in quant_config.overrides if isinstance(o, kind)]


def family_default_of(cls: type) -> FamilyDefault | None:
    """The BF16 default of transformer class ``cls`` (:data:`~vllm_omni_mxfp4.config.defaults.FAMILY_DEFAULTS`)."""
    for default in FAMILY_DEFAULTS.values():
        if (default.module, default.class_name) == (cls.__module__, cls.__name__):
            return default
    return None


def with_family_default(quant_config: Any, default: FamilyDefault) -> Any:
    """``quant_config`` with ``default`` attached, or ``quant_config`` itself when the default does
    not apply (not one of our configs; for a recipe's default, an offline checkpoint or a config
    with ``ignored_layers``). One INFO line says which layers stay BF16 and why."""
    from .quant_config import MxQuantizationConfig

    if not isinstance(quant_config, MxQuantizationConfig) or not default.applies_to(quant_config.config):
        return quant_config
    method, patterns = quant_config.config.METHOD, ", ".join(default.bf16)
    if default.required:
        logger.info(
            "vllm-omni-mxfp4: %s built with %s: Linears matching %s stay BF16 (%s)",
            default.class_name, method, patterns, default.source,
        )  # fmt: skip
    else:
        logger.info(
            "vllm-omni-mxfp4: %s built with %s and no ignored_layers: Linears matching %s stay BF16 "
            "(%s); give ignored_layers to choose the BF16 layers yourself",
            default.class_name, method, patterns, default.source,
        )  # fmt: skip
    return with_override(quant_config, default)
