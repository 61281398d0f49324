"""``vllm-omni-mxfp4 inspect``: validate a checkpoint before deployment, without the engine.

For each transformer component of a pipeline: the method auto-detection picks, then each runtime
Linear of vLLM-Omni's model class (built on the meta device, the checkpoint traced through the
model's own loader) with its format, precision, Smooth, tensors and every inconsistency.

- :mod:`.components`: :func:`inspect_path`, the checkpoint kinds (ours, NVFP4, plain BF16);
- :mod:`.model`: the model class, built and walked (torch, vLLM and vLLM-Omni, imported lazily);
- :mod:`.records`: what the walk finds, as plain data;
- :mod:`.checks`: each runtime Linear against its checkpoint tensors (:mod:`vllm_omni_mxfp4.spec`);
- :mod:`.report`: the report, its table and JSON.

Importing this package imports no torch; the model walk does, when a component is inspected.
"""

from .components import inspect_path
from .report import ComponentReport, InspectReport, LayerRow, format_table

__all__ = ["ComponentReport", "InspectReport", "LayerRow", "format_table", "inspect_path"]
