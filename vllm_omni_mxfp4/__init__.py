"""vLLM-Omni MXFP4: W4A4 MXFP4 and DualScale Linear methods for diffusion transformers.

Importing this package imports nothing else. The vLLM-Omni glue (``vllm_omni_mxfp4.omni``) and the
CPU platform (``vllm_omni_mxfp4.platform``) are loaded through vLLM-Omni's entry points; the
layout and the rules between subpackages are in ``docs/design.md``.
"""

__version__ = "0.1.0"
