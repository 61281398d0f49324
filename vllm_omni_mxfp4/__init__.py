"""vLLM-Omni MXFP4: W4A4 MXFP4 and DualScale Linear methods for diffusion transformers.

Importing this package imports torch only; the vLLM / vLLM-Omni glue lives in
``vllm_omni_mxfp4.omni`` and is loaded by vLLM-Omni's plugin mechanism.
"""

__version__ = "0.1.0"
