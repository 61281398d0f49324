"""NVFP4 sources next to MXFP4: output quality of the tiny Wan2.2 transformer, emulated in float32.

One forward pass of the demo's tiny diffusers ``WanTransformer3DModel`` (seeded random BF16
weights, fixed random inputs) per row, with every block Linear (the ones vLLM-Omni quantizes)
replaced by an emulation, against the same model unquantized:

- ``nvfp4 (native)``: the weight quantized to NVFP4 the way ModelOpt does and dequantized, the
  Linear's input fake-quantized to NVFP4 (dynamic per-tensor scale: the format's best case);
- ``nvfp4->mxfp4 <rule>``: that NVFP4 weight requantized to MXFP4 under each rule
  (``requantize_nvfp4``), activations fake-quantized to MXFP4 (OCP ``floor``), as our Linear
  methods run an NVFP4 checkpoint;
- ``bf16->mxfp4``: the BF16 weight quantized to MXFP4 directly (online ``mxfp4``).

Quality is measured at the transformer's output (PSNR against the reference's peak, cosine), not
on generated frames: one step of the denoiser, where the formats differ and nothing else does.
``python -m vllm_omni_mxfp4_demo.nvfp4_quality`` prints the table; the demo adds it to its report.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from vllm_omni_mxfp4.formats import dequantize_mx, fake_quantize_mx, quantize_mx
from vllm_omni_mxfp4.formats.nvfp4 import dequantize_nvfp4, fake_quantize_nvfp4, quantize_nvfp4
from vllm_omni_mxfp4.formats.requant import REQUANT_RULES
from vllm_omni_mxfp4.kernels.requant import requantize_nvfp4

SEED = 1234
Emulation = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


def _nvfp4_then(rule: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def weight(w: torch.Tensor) -> torch.Tensor:
        result = requantize_nvfp4(quantize_nvfp4(w), rule)
        return dequantize_mx(result.data, result.scale)

    return weight


def emulations() -> dict[str, Emulation]:
    """Row name -> (weight transform, activation transform), both float32 in and out."""
    mx_act = fake_quantize_mx  # OCP floor, what the emulated backend runs
    rows: dict[str, Emulation] = {
        "nvfp4 (native)": (
            lambda w: dequantize_nvfp4(quantize_nvfp4(w), order="scale_first"),
            fake_quantize_nvfp4,
        )
    }
    rows |= {f"nvfp4->mxfp4 {rule}": (_nvfp4_then(rule), mx_act) for rule in REQUANT_RULES}
    rows["bf16->mxfp4"] = (lambda w: dequantize_mx(*quantize_mx(w)), mx_act)
    return rows


def tiny_transformer() -> torch.nn.Module:
    """The demo's tiny Wan2.2 transformer (its config, seeded BF16 weights), in float32 for the math."""
    from diffusers import WanTransformer3DModel

    from vllm_omni_mxfp4_tiny.wan import tiny_transformer_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = WanTransformer3DModel(**tiny_transformer_config())
    for p in model.parameters():  # the BF16 weights the demo stores, computed in float32
        p.data = p.data.bfloat16().float()
    return model.eval()


def _inputs(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    return {
        "hidden_states": torch.randn(1, config["in_channels"], 5, 16, 16, generator=gen),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 16, config["text_dim"], generator=gen),
        "return_dict": False,
    }


def _block_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {
        n: m for n, m in model.named_modules() if n.startswith("blocks.") and isinstance(m, torch.nn.Linear)
    }


def _run(model: torch.nn.Module, inputs: dict[str, Any], emulation: Emulation | None) -> torch.Tensor:
    """The model's output with ``emulation`` on every block Linear (weights restored afterwards)."""
    linears = _block_linears(model)
    saved = {n: m.weight.data for n, m in linears.items()}
    hooks = []
    try:
        if emulation is not None:
            weight_fn, act_fn = emulation
            for module in linears.values():
                module.weight.data = weight_fn(module.weight.data.float())
                hooks.append(module.register_forward_pre_hook(lambda _m, args: (act_fn(args[0]), *args[1:])))
        with torch.no_grad():
            return model(**inputs)[0].double()
    finally:
        for h in hooks:
            h.remove()
        for n, m in linears.items():
            m.weight.data = saved[n]


def psnr_cosine(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """PSNR in dB against the reference's peak |value|, and cosine similarity (float64)."""
    mse = float(((out - ref) ** 2).mean())
    peak = float(ref.abs().max())
    psnr = math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)
    return psnr, float(torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0))


def weight_rel_rms(model: torch.nn.Module, weight_fn: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """||W_q - W|| / ||W|| over all block Linear weights together (float64)."""
    err = ref = 0.0
    for module in _block_linears(model).values():
        w = module.weight.data.float()
        err += float(((weight_fn(w) - w).double() ** 2).sum())
        ref += float((w.double() ** 2).sum())
    return math.sqrt(err / ref)


def measure() -> list[dict[str, Any]]:
    """One row per emulation: ``{"format", "psnr_db", "cosine", "weight_rel_rms"}`` against the
    unquantized model."""
    model = tiny_transformer()
    inputs = _inputs(model.config)
    reference = _run(model, inputs, None)
    rows = []
    for name, emulation in emulations().items():
        psnr, cos = psnr_cosine(_run(model, inputs, emulation), reference)
        rel = weight_rel_rms(model, emulation[0])
        rows.append(
            {
                "format": name,
                "psnr_db": round(psnr, 2),
                "cosine": round(cos, 6),
                "weight_rel_rms": round(rel, 5),
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width text table."""
    lines = [f"{'format':<22} {'PSNR dB':>8} {'cosine':>9} {'weight rel_rms':>15}", "-" * 57]
    lines += [
        f"{r['format']:<22} {r['psnr_db']:8.2f} {r['cosine']:9.6f} {r['weight_rel_rms']:15.5f}" for r in rows
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print("Transformer output of the tiny Wan2.2 model vs unquantized (block Linears emulated, float32):")
    print(format_table(measure()))
