"""vLLM-Omni general plugin of the demo: ``ZImagePipeline`` builds its transformer from the pipeline's
``transformer/config.json``.

vLLM-Omni 0.30's ``ZImagePipeline.__init__`` (``vllm_omni/diffusion/models/z_image/pipeline_z_image.py``,
line 228: ``self.transformer = ZImageTransformer2DModel(quant_config=od_config.quantization_config)``)
builds the transformer with the class' default arguments, the 6B model (dim 3840, 30 layers), and
never reads the checkpoint's ``transformer/config.json``. Any other Z-Image shape cannot load, the
demo's tiny Z-Image pipeline (:mod:`.tiny.z_image`) included. :func:`install` wraps that
``__init__`` so that, while it runs, its ``ZImageTransformer2DModel`` receives the keys of
``<model>/transformer/config.json`` that its constructor takes (lists where the default is a tuple
become tuples; other keys, ``_class_name`` for one, are left out and logged at debug level).

The released 6B checkpoints are unaffected in what they load and compute: every key of their config
that shapes a weight equals the constructor's default; the RoPE table length ``axes_lens`` may be
longer than the default (positions are independent, so the table's first entries are the same
values and only longer captions fit). Models given as a hub id, not a local directory, keep
upstream's behaviour (the transformer's config is not downloaded when the pipeline is built).
``MingImageDiffusionPipeline`` and ``MingImagePipeline`` subclass ``ZImagePipeline`` but skip its
``__init__``, so nothing changes for them.

Registered in ``examples/demo/pyproject.toml`` under ``vllm_omni.general_plugins``: vLLM-Omni runs
general plugins in every process it starts, the diffusion workers that build the pipeline included.
The demo's distribution only; the runtime package ``vllm_omni_mxfp4`` does not carry it.
``tests/demo/test_z_image_config.py`` fails once upstream reads the config itself: then drop this
module and its entry point.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PIPELINE_MODULE = "vllm_omni.diffusion.models.z_image.pipeline_z_image"

_MARK = "_vllm_omni_mxfp4_demo_reads_transformer_config"
"""Attribute set on the wrapped ``__init__``: :func:`install` wraps it once per process."""


def transformer_kwargs(model: str | os.PathLike[str] | None, cls: type) -> dict[str, Any]:
    """The constructor arguments of ``cls`` that ``<model>/transformer/config.json`` gives.

    Empty when ``model`` is not a local directory or has no such file. Raises :class:`ValueError`
    naming the file when it is not a JSON object.
    """
    if model is None or not os.path.isdir(model):
        return {}
    path = Path(model) / "transformer" / "config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"{path}: expected the diffusers config of ZImageTransformer2DModel (a JSON object), "
            f"could not read it ({exc}); fix or regenerate the file"
        ) from exc
    if not isinstance(config, dict):
        raise ValueError(
            f"{path}: expected the diffusers config of ZImageTransformer2DModel (a JSON object), "
            f"found a JSON {type(config).__name__}; fix or regenerate the file"
        )
    parameters = inspect.signature(cls.__init__).parameters
    kwargs = {}
    for key, value in config.items():
        if key in parameters and key not in ("self", "quant_config"):
            default = parameters[key].default
            kwargs[key] = tuple(value) if isinstance(default, tuple) and isinstance(value, list) else value
    left_out = sorted(set(config) - set(kwargs))
    if left_out:
        logger.debug("Z-Image: keys of %s that %s does not take: %s", path, cls.__name__, left_out)
    return kwargs


@contextlib.contextmanager
def _configured_transformer(module: Any, kwargs: dict[str, Any]) -> Iterator[None]:
    """``module.ZImageTransformer2DModel`` takes ``kwargs`` as defaults inside the block."""
    cls = module.ZImageTransformer2DModel
    module.ZImageTransformer2DModel = functools.partial(cls, **kwargs)
    try:
        yield
    finally:
        module.ZImageTransformer2DModel = cls


def install() -> bool:
    """Make ``ZImagePipeline`` build its transformer from ``transformer/config.json``; idempotent.

    Returns whether the fix is in place: False (logged at debug level) when vLLM-Omni's Z-Image
    pipeline module does not import, so nothing is changed.
    """
    try:
        pipeline_z_image = importlib.import_module(PIPELINE_MODULE)
    except ImportError as exc:
        logger.debug("Z-Image: vLLM-Omni's z_image pipeline does not import (%s); nothing to fix", exc)
        return False
    _route_to_vllm_logging()
    pipeline_cls = pipeline_z_image.ZImagePipeline
    original = pipeline_cls.__init__
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kw: Any) -> None:
        od_config = kw.get("od_config", args[0] if args else None)
        model = getattr(od_config, "model", None)
        kwargs = transformer_kwargs(model, pipeline_z_image.ZImageTransformer2DModel)
        if not kwargs:
            original(self, *args, **kw)
            return
        logger.info(
            "Z-Image: building ZImageTransformer2DModel from %s/transformer/config.json (%s) instead of "
            "its default arguments (vllm-omni-mxfp4-demo's fix for vLLM-Omni's ZImagePipeline)",
            model,
            ", ".join(f"{k}={kwargs[k]}" for k in ("dim", "n_layers", "n_heads") if k in kwargs),
        )
        with _configured_transformer(pipeline_z_image, kwargs):
            original(self, *args, **kw)

    setattr(__init__, _MARK, True)
    pipeline_cls.__init__ = __init__
    logger.debug("Z-Image: ZImagePipeline now builds its transformer from transformer/config.json")
    return True


def _route_to_vllm_logging() -> None:
    """Show this module's INFO lines in vLLM's output: its logger under ``vllm``'s once vLLM has a
    handler (vLLM configures only its own logger), as vLLM-Omni does for its package."""
    vllm_root = logging.getLogger("vllm")
    if vllm_root.handlers:
        logger.parent = vllm_root
