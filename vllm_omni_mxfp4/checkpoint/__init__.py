"""msModelSlim -> diffusers checkpoint tools: readers, the Wan2.2 name tables, a streaming writer, the merge.

Importing this package does not import torch: the merge streams bytes and validates with numpy.
"""

from .errors import CheckpointError
from .merger import AUTO, MODEL_TYPES, UNSERVED_MODEL_TYPES, MergeReport, merge, resolve_model_type
from .names import (
    diffusers_to_wan,
    runtime_layer_name,
    strip_smooth_wrapper,
    wan_to_diffusers,
)
from .plan import MXFP8_POLICIES, NON_BLOCK_POLICIES, WEIGHT_LAYOUTS, TransformerReport, plan_transformer

__all__ = [
    "AUTO",
    "MODEL_TYPES",
    "MXFP8_POLICIES",
    "NON_BLOCK_POLICIES",
    "UNSERVED_MODEL_TYPES",
    "WEIGHT_LAYOUTS",
    "CheckpointError",
    "MergeReport",
    "TransformerReport",
    "diffusers_to_wan",
    "merge",
    "plan_transformer",
    "resolve_model_type",
    "runtime_layer_name",
    "strip_smooth_wrapper",
    "wan_to_diffusers",
]
