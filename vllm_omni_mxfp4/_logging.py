"""Route the package's log records through vLLM's handler when running inside vLLM.

vLLM configures a handler on its ``vllm`` logger only; vLLM-Omni re-parents its own package logger
under it. Doing the same for ``vllm_omni_mxfp4`` makes our INFO lines (the chosen backend, the CPU
platform, shard padding) appear in vLLM's output with its format. Outside vLLM nothing changes.
"""

from __future__ import annotations

import logging

PACKAGE_LOGGER = "vllm_omni_mxfp4"


def attach_to_vllm_logging() -> None:
    """Make ``vllm_omni_mxfp4``'s logger a child of ``vllm``'s once vLLM has configured it."""
    vllm_root = logging.getLogger("vllm")
    if vllm_root.handlers:
        logging.getLogger(PACKAGE_LOGGER).parent = vllm_root
