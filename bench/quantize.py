"""Throughput of the MX numerics core next to a memory-copy baseline measured in the same run.

    python bench/quantize.py [--sizes 4096 8192] [--repeats 7] [--device cpu]

For bf16 inputs of N x N it times quantize (GB/s of bf16 input) and dequantize (GB/s of bf16
output) for fp4/floor, fp4/uos and dual-scale, next to two copies of the same tensor (GB/s read +
write): ``clone()`` (into fresh memory, which the OS must fault in page by page) and ``copy_()``
into a preallocated tensor (the memory-bandwidth limit). Quantize writes fresh outputs like
``clone()``; dequantize is timed both ways (``out=``). The ratio column is op time / clone time:
these machines are noisy, so compare ratios, not absolute numbers. When torchao is installed it also times ``MXTensor.to_mx`` (FLOOR) on the same
tensor and reports the speed ratio and the fraction of bytes on which the two agree.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from vllm_omni_mxfp4.formats import dequantize_dualscale, dequantize_mx, quantize_dualscale, quantize_mx


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after one warm-up."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torchao_to_mx() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
    """torchao's FLOOR MXFP4 quantizer as ``x -> (packed uint8, e8m0 uint8)``, if installed."""
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except ImportError:
        return None

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale, data = to_mx(x, torch.float4_e2m1fn_x2, 32)
        return data.view(torch.uint8).reshape(x.shape[0], -1), scale.view(torch.uint8).reshape(x.shape[0], -1)

    return run


def measure(x: torch.Tensor, repeats: int, device: torch.device) -> list[tuple[str, float, float]]:
    """(op, seconds, bytes per second) for the copies and the ops of :mod:`vllm_omni_mxfp4.formats` on ``x``."""
    nbytes = x.numel() * x.element_size()
    t_copy = timed(lambda: x.clone(), repeats, device)
    dst = torch.empty_like(x)
    t_copy_pre = timed(lambda: dst.copy_(x), repeats, device)
    rows = [
        ("copy: clone()", t_copy, 2 * nbytes / t_copy),
        ("copy: copy_() prealloc", t_copy_pre, 2 * nbytes / t_copy_pre),
    ]
    for rule in ("floor", "uos"):
        t = timed(lambda rule=rule: quantize_mx(x, scale_rule=rule), repeats, device)
        rows.append((f"quantize fp4/{rule}", t, nbytes / t))
    data, scale = quantize_mx(x)
    t = timed(lambda: dequantize_mx(data, scale, dtype=torch.bfloat16), repeats, device)
    rows.append(("dequantize fp4", t, nbytes / t))
    t = timed(lambda: dequantize_mx(data, scale, dtype=torch.bfloat16, out=dst), repeats, device)
    rows.append(("dequantize fp4 (out=)", t, nbytes / t))
    t = timed(lambda: quantize_dualscale(x), repeats, device)
    rows.append(("quantize dual-scale", t, nbytes / t))
    dual = quantize_dualscale(x)
    t = timed(lambda: dequantize_dualscale(*dual, dtype=torch.bfloat16), repeats, device)
    rows.append(("dequantize dual-scale", t, nbytes / t))
    return rows


def compare_torchao(ao, x: torch.Tensor, ours_seconds: float, repeats: int, device: torch.device) -> str:
    """torchao's FLOOR quantizer on ``x``: its speed relative to ours and the fraction of equal bytes."""
    n = x.shape[0]
    t_ao = timed(lambda: ao(x), max(2, repeats // 2), device)
    data, scale = quantize_mx(x)
    ao_data, ao_scale = ao(x)
    agree_data = (ao_data == data).float().mean().item()
    agree_scale = (ao_scale == scale).float().mean().item()
    return (
        f"{n:>5}x{n:<4} torchao to_mx FLOOR {t_ao * 1e3:9.2f} ms -> ours {t_ao / ours_seconds:.1f}x faster; "
        f"bytes agree: data {agree_data:.4%}, scales {agree_scale:.4%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}")
    header = f"{'size':>10} {'op':<24} {'ms':>9} {'GB/s':>8} {'x copy':>8}"
    print(header)
    print("-" * len(header))
    ao = torchao_to_mx() if device.type == "cpu" else None
    for n in args.sizes:
        g = torch.Generator(device=device).manual_seed(n)
        x = torch.randn(n, n, generator=g, device=device).to(torch.bfloat16)
        rows = measure(x, args.repeats, device)
        t_copy = rows[0][1]
        for name, t, rate in rows:
            print(f"{n:>5}x{n:<4} {name:<24} {t * 1e3:9.2f} {rate / 1e9:8.2f} {t / t_copy:8.1f}")
        if ao is not None:
            print(compare_torchao(ao, x, rows[2][1], args.repeats, device))
    if ao is None and device.type == "cpu":
        print("torchao not installed: no peer comparison (pip install torchao to add it)")
    print(
        "Summary: GB/s counts bf16 bytes in (quantize) or out (dequantize), copies count read + write; "
        "'x copy' is time relative to clone() of the same tensor in this run."
    )


if __name__ == "__main__":
    main()
