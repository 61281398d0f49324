"""msModelSlim -> diffusers checkpoint tools: msModelSlim export readers, validation, the output plan, the merge.

Importing this package does not import torch: the merge streams bytes and validates with numpy.
"""

from ..errors import CheckpointError
from .merger import AUTO, MODEL_TYPES, UNSERVED_MODEL_TYPES, MergeReport, merge, resolve_model_type
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
    "merge",
    "plan_transformer",
    "resolve_model_type",
]
