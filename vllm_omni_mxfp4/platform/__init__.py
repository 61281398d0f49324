"""CPU platform plugin for vLLM-Omni (entry point group ``vllm_omni.platform_plugins``)."""

from __future__ import annotations


def activate() -> str | None:
    """Return the platform class path when the CPU platform should be active, else None."""
    return None


def install_fixups() -> None:
    """General-plugin entry point: runtime fix-ups the CPU platform needs (no-op elsewhere)."""
    return None
