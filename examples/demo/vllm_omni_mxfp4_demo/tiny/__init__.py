"""Tiny models for the demo, the tests and the docs: built locally in seconds, no download.

- :mod:`.wan`: :func:`build_tiny_wan`, the cached tiny two-expert Wan2.2 diffusers pipeline, and
  :func:`tiny_transformer_config`, the one definition of its transformer config (test fixtures
  derive their variants from it);
- :mod:`.msmodelslim_export`: real msModelSlim exports of a diffusers Wan2.2 pipeline, made on CPU
  (imported on its own: it needs torch, and msModelSlim when it runs).
"""

from .wan import build_tiny_wan, tiny_transformer_config

__all__ = ["build_tiny_wan", "tiny_transformer_config"]
