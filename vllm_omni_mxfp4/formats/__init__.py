"""Numerics of MX formats: E2M1 / E4M3 elements, E8M0 scales, the vendor scale rules, dual-level.

Pure torch, any device. This package is the ground truth the kernels are tested against. Its
constants (``MX_BLOCK_SIZE``, ``DUAL_BLOCK_SIZE``, ``NAN_CODE``, ``UOS_DST_TYPE_MAX``, ``E2M1_VALUES``,
``E2M1_MAX``) are the values of :mod:`vllm_omni_mxfp4.spec` under the names the kernels use.

- :mod:`.e2m1`: E2M1 encoding, decoding and nibble packing;
- :mod:`.scale_rules`: E8M0 codes from block maxima, one function per vendor rule;
- :mod:`.mx`: MX block quantization (FP4 / FP8), dequantization and quantize-dequantize;
- :mod:`.mxfp8`: MXFP8 (E4M3 codes, the OCP block rule) of the W8A8 layers in ``mxfp8_layers``;
- :mod:`.dualscale`: the dual-level format (coarse float32 scale per 512 over MXFP4);
- :mod:`.layout`: the NPU scale layout;
- :mod:`.rows`: row chunking and block padding shared by the quantizers;
- :mod:`.nvfp4`: the canonical NVFP4 weight (E2M1 codes, E4M3 scale per 16, float32 global scale)
  and its exact float32 dequantization;
- :mod:`.requant`: NVFP4 -> MXFP4 requantization per 32-block (``floor``, ``even``, ``rceil``,
  ``mse``) with a per-layer error report;
- :mod:`.low_rank`: a weight's rank-r pair and the residual that is quantized (``svd_rank``).
"""

from .dualscale import DUAL_BLOCK_SIZE, dequantize_dualscale, level0_scales, quantize_dualscale
from .e2m1 import E2M1_MAX, E2M1_VALUES, e2m1_decode, e2m1_encode, pack_fp4, unpack_fp4
from .layout import from_npu_scale_layout, to_npu_scale_layout
from .low_rank import low_rank_pair, split_weight
from .mx import MX_BLOCK_SIZE, block_amax, dequantize_mx, fake_quantize_mx, quantize_mx
from .mxfp8 import (
    MXFP8_SCALE_RULE,
    dequantize_mxfp8,
    e4m3_decode,
    e4m3_encode,
    fake_quantize_mxfp8,
    quantize_mxfp8,
)
from .nvfp4 import Nvfp4Weight, dequantize_nvfp4
from .requant import REQUANT_RULES, requantize_nvfp4
from .scale_rules import (
    NAN_CODE,
    SCALE_RULES,
    UOS_DST_TYPE_MAX,
    e8m0_to_float,
    shared_exponent_codes,
)

__all__ = [
    "DUAL_BLOCK_SIZE",
    "E2M1_MAX",
    "E2M1_VALUES",
    "MX_BLOCK_SIZE",
    "MXFP8_SCALE_RULE",
    "NAN_CODE",
    "REQUANT_RULES",
    "Nvfp4Weight",
    "SCALE_RULES",
    "UOS_DST_TYPE_MAX",
    "block_amax",
    "dequantize_dualscale",
    "dequantize_mx",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_decode",
    "e4m3_encode",
    "e8m0_to_float",
    "fake_quantize_mx",
    "fake_quantize_mxfp8",
    "from_npu_scale_layout",
    "level0_scales",
    "low_rank_pair",
    "pack_fp4",
    "quantize_dualscale",
    "quantize_mx",
    "quantize_mxfp8",
    "requantize_nvfp4",
    "shared_exponent_codes",
    "split_weight",
    "to_npu_scale_layout",
    "unpack_fp4",
]
