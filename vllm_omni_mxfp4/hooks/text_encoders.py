"""Text encoders that vLLM-Omni builds through ``create_transformers_model`` stay BF16 under our methods.

vLLM-Omni 0.30's ``create_transformers_model`` (``diffusion/models/utils.py``; Z-Image's Qwen3 text
encoder) turns the Hugging Face model's ``nn.Linear`` modules into vLLM Linears with the pipeline's
quantization config (``recursive_replace_linear``) and then replaces every meta-device parameter
with a plain one (``init_parameters``), which drops the weight loaders those Linears' methods
attached. The weights then load through vLLM's default loader, unseen by our methods, so each of
these Linears would be refused at load (``online mxfp4 needs the complete BF16 weight, but 0 of
... elements were loaded``), with a released checkpoint as with a tiny one.

``--quantization mxfp4`` is for the diffusion transformer, not the text encoder; under our configs
(alone, or in a per-component config) these Linears are therefore built unquantized, as without
``--quantization``, and that is logged. Other quantization methods are left as vLLM-Omni builds
them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from ..patching import wrap_once

logger = logging.getLogger(__name__)


def _is_ours(spec: Any) -> bool:
    """Whether the pipeline's quantization config is one of ours, or a per-component config holding one."""
    from vllm_omni.quantization import build_quant_config
    from vllm_omni.quantization.component_config import ComponentQuantizationConfig

    from ..omni.quant_config import MxQuantizationConfig

    config = build_quant_config(spec)
    if isinstance(config, ComponentQuantizationConfig):
        parts = [*config.component_configs.values(), config.default_config]
        return any(isinstance(part, MxQuantizationConfig) for part in parts)
    return isinstance(config, MxQuantizationConfig)


@contextlib.contextmanager
def _without_quantization(od_config: Any) -> Iterator[None]:
    """``od_config`` with no quantization config for the duration (the build is single-threaded)."""
    saved = od_config.quantization_config
    od_config.quantization_config = None
    try:
        yield
    finally:
        od_config.quantization_config = saved


def _bf16_under_ours(original: Any) -> Any:
    """``recursive_replace_linear`` building the Hugging Face model's Linears unquantized under our configs."""

    def run(model: Any, od_config: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_ours(getattr(od_config, "quantization_config", None)):
            return original(model, od_config, *args, **kwargs)
        logger.info(
            "%s: built with BF16 Linears; mxfp4 quantizes the diffusion transformer, and vLLM-Omni's "
            "create_transformers_model replaces the Linears' parameters, which a quantized method needs",
            type(model).__name__,
        )
        with _without_quantization(od_config):
            return original(model, od_config, *args, **kwargs)

    return run


def install() -> None:
    """Wrap ``vllm_omni.diffusion.models.utils.recursive_replace_linear`` (looked up by
    ``create_transformers_model`` in its own module at call time); idempotent."""
    from vllm_omni.diffusion.models import utils

    wrap_once(utils, "recursive_replace_linear", _bf16_under_ours, "text_encoders")
