"""NVFP4 -> MXFP4 requantization speed and memory, next to BF16 -> MXFP4 quantization in the same run.

    python bench/requant.py [--shape 13824 5120] [--rules floor even rceil mse] [--repeats 3] [--threads N]

Builds one NVFP4 weight of ``--shape`` (default: Wan2.2-A14B's largest Linear, ``ffn.net.0``) from a
random BF16 weight (``quantize_nvfp4``, ModelOpt's recipe), then times :func:`~vllm_omni_mxfp4.formats.requant.requantize_nvfp4` per rule
(dequant, requant and the error report) and ``quantize_mx`` of the same BF16 weight (what online
BF16 -> MXFP4 quantization of the layer costs). It reports weights per CPU second (the process's
CPU time, best of ``--repeats`` runs: the runners are shared, and other jobs inflate wall time)
and the ratio to ``quantize_mx``, and the peak extra resident
memory of each call (RSS sampled every millisecond, above the RSS before the call, inputs already
allocated) next to the layer's MXFP4 output and to one layer in float32 (the budget: peak extra
<= one float32 layer, 283 MB for 13824 x 5120). ``--threads`` sets torch's thread count: on
oversubscribed shared runners more threads than free cores spin and inflate CPU time.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

import psutil
import torch

from vllm_omni_mxfp4 import spec
from vllm_omni_mxfp4.formats import quantize_mx
from vllm_omni_mxfp4.formats.nvfp4 import quantize_nvfp4
from vllm_omni_mxfp4.formats.requant import REQUANT_RULES, requantize_nvfp4


class PeakRss:
    """Peak resident memory above the level at entry, sampled every millisecond in a thread."""

    def __enter__(self) -> PeakRss:
        self._proc = psutil.Process()
        self.base = self._proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def extra(self) -> int:
        return self.peak - self.base


def measure(fn: Callable[[], object], repeats: int) -> tuple[float, int]:
    """(best CPU seconds, largest peak extra RSS in bytes) of ``fn`` over ``repeats`` runs after a
    warm-up. CPU time of this process, best of the runs: other jobs on shared cores inflate wall
    time, not that. Each requantization run builds its own lookup tables, so they are counted."""
    fn()
    times, extra = [], 0
    for _ in range(repeats):
        with PeakRss() as rss:
            start = time.process_time()
            result = fn()
            times.append(time.process_time() - start)
            del result
        extra = max(extra, rss.extra)
    return min(times), extra


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", type=int, nargs=2, default=[13824, 5120], metavar=("N", "K"))
    parser.add_argument("--rules", nargs="+", default=list(REQUANT_RULES), choices=REQUANT_RULES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n, k = args.shape
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    nv = quantize_nvfp4(w, name="ffn.net.0.proj")
    fp32_layer, mx_out = n * k * 4, n * k // 2 + n * spec.ceil_div(k, spec.MX_BLOCK)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, layer {n}x{k} ({n * k / 1e6:.1f}M weights)"
    )
    print(f"one layer in float32: {fp32_layer / 1e6:.0f} MB; MXFP4 output: {mx_out / 1e6:.0f} MB")
    header = f"{'op':<28} {'CPU s':>8} {'Mweights/s':>11} {'x quantize_mx':>14} {'peak extra MB':>14} {'/ fp32 layer':>13}"
    print(header)
    print("-" * len(header))
    base_t, base_mem = measure(lambda: quantize_mx(w, scale_rule="floor"), args.repeats)
    rows = [("quantize_mx bf16 (floor)", base_t, base_mem)]
    for rule in args.rules:
        t, mem = measure(lambda rule=rule: requantize_nvfp4(nv, rule), args.repeats)
        rows.append((f"requantize_nvfp4 ({rule})", t, mem))
    for name, t, mem in rows:
        print(
            f"{name:<28} {t:8.2f} {n * k / t / 1e6:11.1f} {base_t / t:14.2f} {mem / 1e6:14.0f} {mem / fp32_layer:13.2f}"
        )
    for rule in args.rules:
        print(requantize_nvfp4(nv, rule).error)
    print(
        "'x quantize_mx' = requant throughput / BF16 quantize_mx throughput in this run (>= 1: requant is "
        "at least as fast); peak extra includes the MXFP4 output."
    )


if __name__ == "__main__":
    main()
