"""Demo of the numerics core: how each vendor scale rule quantizes the same tensors.

    python -m vllm_omni_mxfp4.demo [--rows 256] [--cols 4096]

Prints, for the golden block maxima of research/kernels.md and for random heavy-tailed activations,
the E8M0 scale each rule picks and the signal-to-quantization-noise ratio it achieves.
"""

from __future__ import annotations

import argparse
import math

import torch

from vllm_omni_mxfp4.formats import (
    SCALE_RULES,
    dequantize_dualscale,
    dequantize_mx,
    quantize_dualscale,
    quantize_mx,
)


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """10 log10(|x|^2 / |x - y|^2)."""
    noise = (x.double() - y.double()).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(x.double().pow(2).sum().item() / noise)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_omni_mxfp4.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=4096)
    args = parser.parse_args(argv)

    maxima = [1.5, 1.75, 6.0, 6.5, 7.0, 7.25, 7.5]
    print("E8M0 code -> dequantized block maximum, per scale rule (one 32-element block, bf16):")
    print(f"{'amax':>6} " + " ".join(f"{r:>14}" for r in SCALE_RULES))
    for a in maxima:
        x = torch.zeros(1, 32, dtype=torch.bfloat16)
        x[0, 0] = a
        cells = []
        for rule in SCALE_RULES:
            data, scale = quantize_mx(x, scale_rule=rule)
            cells.append(f"{scale.item():>4} -> {dequantize_mx(data, scale)[0, 0].item():<6g}")
        print(f"{a:>6} " + " ".join(f"{c:>14}" for c in cells))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.cols, generator=g) * torch.exp(
        torch.randn(args.rows, args.cols, generator=g)
    )
    x = x.to(torch.bfloat16)
    print(f"\nSQNR on heavy-tailed bf16 activations {tuple(x.shape)} (higher is better):")
    for rule in SCALE_RULES:
        data, scale = quantize_mx(x, scale_rule=rule)
        print(f"  fp4 {rule:<13} {sqnr_db(x, dequantize_mx(data, scale)):6.2f} dB")
    data, scale = quantize_mx(x, elem="fp8")
    print(f"  fp8 floor         {sqnr_db(x, dequantize_mx(data, scale, elem='fp8')):6.2f} dB")
    if args.cols % 2 == 0:
        d, s, l0 = quantize_dualscale(x)
        print(f"  fp4 dual-scale    {sqnr_db(x, dequantize_dualscale(d, s, l0)):6.2f} dB")
    print("\nDone: every rule above is bit-exact with its vendor kernel (see tests/formats).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
