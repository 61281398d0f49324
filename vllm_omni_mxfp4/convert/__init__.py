"""NVFP4 -> offline MXFP4 checkpoints (``vllm-omni-mxfp4 convert``).

- :mod:`.run`: :func:`convert` (pipeline or one transformer; staging + atomic rename) and its report;
- :mod:`.plan`: one transformer directory planned layer by layer (what becomes MXFP4, BF16 or stays);
- :mod:`.targets`: the vLLM-Omni transformers it writes for (quantizable and fused Linears);
- :mod:`.tensors`: the output tensors computed with torch (requantized, dequantized, split rows);
- :mod:`.reader`: lazy, memory-mapped reading of the input tensors.

Torch is needed here (the requantization), unlike :mod:`vllm_omni_mxfp4.checkpoint`, whose writer,
staging and validation this package reuses.
"""

from .plan import ConvertedComponent, LayerReport
from .run import DEFAULT_RULE, ConvertReport, convert

__all__ = ["DEFAULT_RULE", "ConvertedComponent", "ConvertReport", "LayerReport", "convert"]
