"""Quantization configs of the ``mxfp4`` and ``mxfp4_dualscale`` methods and their layer routing.

Users steer quantization through a config: a method name, a JSON object (string or file), a Python
dict, or the ``quantization_config`` block of a checkpoint's ``transformer/config.json``. This
package parses and validates all of them strictly, decides each Linear layer's precision
(BF16 > W4A8 by layer or step > W4A4), selects per-expert configs and reconciles a runtime config
with the checkpoint's own. The rules are the vLLM-Omni MXFP4 user guide's.

- :mod:`.keys`: how a key is declared (default, validator, role) and the validators.
- :mod:`.methods`: :class:`Mxfp4Config`, :class:`Mxfp4DualScaleConfig` and their base.
- :mod:`.routing`: :class:`Precision`, :class:`LayerRoute`.
- :mod:`.parse`: :func:`parse_quantization`, :class:`ComponentConfigs`.
- :mod:`.reconcile`: :func:`reconcile_with_checkpoint`, :func:`resolve_component`, the mirror of
  vLLM-Omni's own reconciliation.
- :mod:`.names`: :func:`check_model_names`, :func:`check_component_names`: the names a config
  lists against the model and the components that are actually built.

Pure Python and stdlib (no torch, no vLLM): the vLLM glue (``vllm_omni_mxfp4.omni``) and the
torch-free merge (``vllm_omni_mxfp4.checkpoint``) both build on it.
"""

from .methods import (
    CONFIG_CLASSES,
    SUPPORTED_METHODS,
    MethodConfig,
    Mxfp4Config,
    Mxfp4DualScaleConfig,
    QuantConfig,
)
from .names import check_component_names, check_model_names
from .parse import ComponentConfigs, parse_quantization
from .reconcile import reconcile_with_checkpoint, resolve_component
from .routing import LayerRoute, Precision

__all__ = [
    "CONFIG_CLASSES",
    "SUPPORTED_METHODS",
    "ComponentConfigs",
    "LayerRoute",
    "MethodConfig",
    "Mxfp4Config",
    "Mxfp4DualScaleConfig",
    "Precision",
    "QuantConfig",
    "check_component_names",
    "check_model_names",
    "parse_quantization",
    "reconcile_with_checkpoint",
    "resolve_component",
]
