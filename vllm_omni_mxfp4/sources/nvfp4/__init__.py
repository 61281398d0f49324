"""NVFP4 checkpoints of every producer, described and normalised in one place (docs/nvfp4.md).

- :mod:`.records`: the typed description (:class:`LayerSource`, :class:`Nvfp4Checkpoint`) and
  :class:`SourceError`, the one refusal type (layer, reason, fix);
- :mod:`.config`: producer configs (ModelOpt flat / nested / MIXED_PRECISION, compressed-tensors,
  SGLang's extra keys) parsed into a :class:`~.config.ProducerConfig`;
- :mod:`.detect`: a checkpoint directory (configs, safetensors headers, Comfy ``.comfy_quant``
  markers) described layer by layer, failing closed;
- :mod:`.layouts`: one layer's stored tensors turned into the canonical
  :class:`~vllm_omni_mxfp4.formats.nvfp4.Nvfp4Weight` (nibble order, 128x4 swizzled scales, global
  multiplier or divisor, fused Q/K/V rows, a foldable ``pre_quant_scale``).
"""

from .config import ProducerConfig, parse_quant_config
from .detect import describe_layers, detect_nvfp4, original_tensors, read_checkpoint_headers
from .layouts import (
    fuse_rows,
    load_mul_scale,
    load_nvfp4_weight,
    strip_padding,
    swap_nibbles,
    unswizzle_scales,
)
from .records import LayerSource, Nvfp4Checkpoint, SourceError

__all__ = [
    "LayerSource",
    "Nvfp4Checkpoint",
    "ProducerConfig",
    "SourceError",
    "describe_layers",
    "detect_nvfp4",
    "fuse_rows",
    "load_mul_scale",
    "load_nvfp4_weight",
    "original_tensors",
    "parse_quant_config",
    "read_checkpoint_headers",
    "strip_padding",
    "swap_nibbles",
    "unswizzle_scales",
]
