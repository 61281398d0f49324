"""The on-disk cache every tiny pipeline builder shares: content keys and atomic builds.

A tiny pipeline is built once per content key (the builder's configs, its seed and the torch /
diffusers / transformers / tokenizers versions) under ``<cache root>/<kind>/<name>_<key>/``, the
cache root being :func:`vllm_omni_mxfp4.envs.cache_dir` (``$VLLM_OMNI_MXFP4_CACHE``) unless a
builder is given another. :func:`cached_build` writes into a staging directory next to the final
one and renames it into place in one step, so a concurrent or interrupted build never leaves a
half-written pipeline where a reader would take it for a finished one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_omni_mxfp4 import envs

logger = logging.getLogger(__name__)


def library_versions() -> dict[str, str]:
    """Versions of the libraries whose code writes the pipeline files (part of every content key)."""
    import diffusers
    import tokenizers
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def content_key(spec: dict[str, Any]) -> str:
    """A short hash of ``spec`` (JSON-serialisable) plus :func:`library_versions`."""
    blob = json.dumps({**spec, "versions": library_versions()}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def files_digest(root: Path, pattern: str = "**/*") -> str:
    """SHA-256 over the relative path and bytes of every file under ``root`` matching ``pattern``, in
    sorted order: a content key that follows what a directory holds, not where it is."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.glob(pattern) if p.is_file()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_root(kind: str, cache_dir: str | Path | None = None) -> Path:
    """``<cache_dir or envs.cache_dir()>/<kind>``: where the builds of one builder live."""
    return (Path(cache_dir).expanduser() if cache_dir is not None else envs.cache_dir()) / kind


def cached_build(final: Path, build: Callable[[Path], None]) -> Path:
    """Return ``final``, calling ``build(staging)`` and renaming the staging directory there first
    when ``final`` has no ``model_index.json`` yet.

    The staging directory is removed whatever happens; losing a race against another process that
    renamed its identical build into place first returns that build.
    """
    if (final / "model_index.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".staging-{final.name}-", dir=final.parent))
    try:
        logger.info("Building tiny pipeline %s", final)
        build(staging)
        try:
            os.rename(staging, final)
        except OSError:
            if not (final / "model_index.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final
