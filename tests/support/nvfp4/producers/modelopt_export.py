"""Make the ModelOpt NVFP4 fixtures of tests/support/nvfp4 with nvidia-modelopt itself, on the CPU.

Not a test: ``nvidia-modelopt`` pins ``setuptools>=80`` and the runtime's vLLM pins
``setuptools==77.0.3``, so the two cannot share one environment. Run this script from a separate
environment that has ``nvidia-modelopt==0.47.0`` on top of the project's packages, for example::

    python -m venv /tmp/nvfp4-producers
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/nvfp4-producers/lib/python3.11/site-packages/shared.pth
    /tmp/nvfp4-producers/bin/pip install -c requirements/constraints.txt nvidia-modelopt==0.47.0
    /tmp/nvfp4-producers/bin/python tests/support/nvfp4/producers/modelopt_export.py tests/support/nvfp4/fixtures/modelopt

It writes, under the output directory:

- ``nvfp4/``: ``export_hf_checkpoint`` of a tiny diffusers Wan2.2 transformer quantized with
  ``NVFP4_DEFAULT_CFG`` (layout A: ``config.json`` with the flat ``quantization_config``);
  plus ``hf_quant_config.json``, ModelOpt's nested form of the same config (``get_quant_config``);
- ``w4a16/``: the same with ``W4A16_NVFP4_CFG`` (weight-only, no ``input_scale``);
- ``mixed/``: NVFP4 with ``blocks.0.ffn.net.2`` in FP8 (:data:`FP8_FFN_OUT`): ModelOpt's
  ``MIXED_PRECISION`` export, flat in ``config.json`` and nested in ``hf_quant_config.json``;
- ``swizzled/``: the NVFP4 export post-processed for single-file runtimes (``padding_strategy="row"``,
  ``enable_swizzle_layout``, ``enable_layerwise_quant_metadata``: 128x4 blocked scales and the
  config in the safetensors header);
- ``dequant.safetensors``: ModelOpt's own float32 dequantization (``NVFP4QTensor.dequantize``) of
  every NVFP4 Linear of ``nvfp4/``, the ground truth our dequantization must equal bit for bit;
- ``lossless.safetensors``: MXFP4 weights (made with ``vllm_omni_mxfp4.formats.quantize_mx``) and
  ModelOpt's closed-form MXFP4 -> NVFP4 cast of them (``quantize_mxfp4_to_nvfp4_lossless``).

One extra config entry keeps Wan's patch-embedding ``Conv3d`` away from NVFP4 quantizers: its
forward otherwise calls a CUDA-only kernel during the export's Q/K/V fusion test forward, which
then skips the fusion (docs/nvfp4.md, "Producer fixtures").
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TINY_WAN = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 2,
    "attention_head_dim": 32,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 128,
    "num_layers": 1,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 64,
}
CONV3D_ENTRY = {
    "quantizer_name": "*",
    "parent_class": "nn.Conv3d",
    "cfg": {"num_bits": [4, 3]},
    "enable": False,
}
FP8_FFN_OUT = [
    {"quantizer_name": "*ffn.net.2.weight_quantizer", "cfg": {"num_bits": [4, 3], "axis": None}},
    {"quantizer_name": "*ffn.net.2.input_quantizer", "cfg": {"num_bits": [4, 3], "axis": None}},
]
"""Entries that make one Linear FP8 in an otherwise NVFP4 config: ModelOpt then exports MIXED_PRECISION."""
LOSSLESS_SHAPE = (64, 256)


def tiny_wan(seed: int = 0) -> torch.nn.Module:
    """A random tiny diffusers Wan2.2 transformer with bf16 weights."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**TINY_WAN).to(torch.bfloat16).eval()


def calibrate(model: torch.nn.Module) -> None:
    """Two forward passes on random latents and text states (max calibration)."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(
            hidden_states=torch.randn(1, 4, 1, 8, 8, generator=gen).bfloat16(),
            timestep=torch.tensor([500]),
            encoder_hidden_states=torch.randn(1, 8, 32, generator=gen).bfloat16(),
            return_dict=False,
        )


def export(cfg: dict, out: Path, extra: list | None = None, **post) -> torch.nn.Module:
    """Quantize a fresh tiny Wan with ``cfg`` (+ the Conv3d entry and ``extra`` entries) and export it."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    cfg = copy.deepcopy(cfg)
    cfg["quant_cfg"].extend([CONV3D_ENTRY, *(extra or [])])
    model = mtq.quantize(tiny_wan(), cfg, forward_loop=calibrate)
    shutil.rmtree(out, ignore_errors=True)
    with torch.no_grad():
        export_hf_checkpoint(model, export_dir=out, **post)
    return model


def nested_config(model: torch.nn.Module) -> dict:
    """ModelOpt's nested ``hf_quant_config.json`` form of the model's quantization (``get_quant_config``)."""
    from modelopt.torch.export.quant_utils import get_quant_config

    return get_quant_config(model, is_modelopt_qlora=False)


def modelopt_dequant(export_dir: Path) -> dict[str, torch.Tensor]:
    """ModelOpt's own float32 dequantization of every NVFP4 Linear in ``export_dir``."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    tensors = {}
    for path in sorted(export_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    out = {}
    for name, scale in tensors.items():
        if not name.endswith(".weight_scale") or scale.dtype != torch.float8_e4m3fn:
            continue
        layer = name.removesuffix(".weight_scale")
        packed = tensors[f"{layer}.weight"]
        shape = (packed.shape[0], packed.shape[1] * 2)
        qt = NVFP4QTensor(torch.Size(shape), torch.float32, packed)
        out[layer] = qt.dequantize(
            dtype=torch.float32,
            scale=scale,
            double_scale=tensors[f"{layer}.weight_scale_2"],
            block_sizes={-1: 16},
        )
    return out


def lossless_cast() -> dict[str, torch.Tensor]:
    """MXFP4 bytes of a random weight with a narrow exponent range, and ModelOpt's cast to NVFP4."""
    from modelopt.torch.export.shard_cast_utils import mxfp4_kmax, quantize_mxfp4_to_nvfp4_lossless

    from vllm_omni_mxfp4.formats import quantize_mx

    gen = torch.Generator().manual_seed(2)
    w = torch.randn(LOSSLESS_SHAPE, generator=gen) * torch.exp2(torch.randint(-6, 6, (LOSSLESS_SHAPE[0], 1)))
    data, scale = quantize_mx(w.bfloat16(), scale_rule="floor")
    data = _positive_zeros(data)
    q, ws, ws2, n_blocks, n_lossless = quantize_mxfp4_to_nvfp4_lossless(data, scale, mxfp4_kmax(scale), "cpu")
    if n_lossless != n_blocks:
        raise RuntimeError(f"ModelOpt's cast is lossless for {n_lossless}/{n_blocks} blocks only")
    return {"mx_weight": data, "mx_scale": scale, "weight": q, "weight_scale": ws, "weight_scale_2": ws2}


def _positive_zeros(packed: torch.Tensor) -> torch.Tensor:
    """MXFP4 bytes with every -0 code (8) replaced by +0: ModelOpt's cast cannot keep a zero's sign."""
    low, high = packed & 0xF, packed >> 4
    low = torch.where(low == 8, torch.zeros_like(low), low)
    high = torch.where(high == 8, torch.zeros_like(high), high)
    return low | (high << 4)


def main(out: Path) -> None:
    import modelopt.torch.quantization as mtq

    out.mkdir(parents=True, exist_ok=True)
    model = export(mtq.NVFP4_DEFAULT_CFG, out / "nvfp4")
    (out / "nvfp4" / "hf_quant_config.json").write_text(json.dumps(nested_config(model), indent=1) + "\n")
    export(mtq.W4A16_NVFP4_CFG, out / "w4a16")
    mixed = export(mtq.NVFP4_DEFAULT_CFG, out / "mixed", extra=FP8_FFN_OUT)
    (out / "mixed" / "hf_quant_config.json").write_text(json.dumps(nested_config(mixed), indent=1) + "\n")
    export(
        mtq.NVFP4_DEFAULT_CFG,
        out / "swizzled",
        padding_strategy="row",
        enable_swizzle_layout=True,
        enable_layerwise_quant_metadata=True,
    )
    save_file(modelopt_dequant(out / "nvfp4"), str(out / "dequant.safetensors"))
    save_file(lossless_cast(), str(out / "lossless.safetensors"))
    (out / "versions.json").write_text(json.dumps(_versions(), indent=1) + "\n")


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("nvidia-modelopt", "torch", "diffusers", "safetensors")}


if __name__ == "__main__":
    main(Path(sys.argv[1]))
