"""What ``svd_rank`` costs at load and in memory, against plain online quantization in the same run.

    python bench/low_rank.py [--shapes 5120x5120 13824x5120 5120x13824] [--ranks 8 16 32] [--repeats 3]

For each BF16 weight shape (N x K; the defaults are Wan2.2-A14B's attention and FFN Linears) it
times online ``mxfp4`` quantization of the weight (the baseline) and, per rank, the split into the
low-rank pair and the residual (``split_weight``) followed by the same quantization of the residual.
It prints the load-time ratio to the baseline, the bytes the pair adds (two BF16 factors) against
the quantized weight's bytes (packed E2M1 plus one E8M0 scale per 32), and the branch's extra
multiply-adds per token against the main GEMM's.
"""

from __future__ import annotations

import argparse

import torch
from linear import timed  # bench/linear.py: median of repeats after a warm-up
from tqdm import tqdm

from vllm_omni_mxfp4.formats import quantize_mx, split_weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["5120x5120", "13824x5120", "5120x13824"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[8, 16, 32])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    rows = []
    for shape in tqdm(args.shapes, desc="shapes"):
        n, k = (int(v) for v in shape.split("x"))
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        base = timed(lambda w=w: quantize_mx(w), args.repeats)
        quantized_bytes = n * k // 2 + n * k // 32
        for rank in args.ranks:
            split = timed(lambda w=w, rank=rank: quantize_mx(split_weight(w, rank)[2]), args.repeats)
            pair_bytes = rank * (n + k) * 2
            rows.append((shape, rank, base, split, pair_bytes / quantized_bytes, rank * (n + k) / (n * k)))

    print(
        f"{'N x K':>12} {'rank':>5} {'quantize s':>11} {'split+quantize s':>17} {'load ratio':>11} "
        f"{'pair bytes / weight bytes':>26} {'branch MACs / GEMM MACs':>24}"
    )
    for shape, rank, base, split, byte_ratio, mac_ratio in rows:
        print(
            f"{shape:>12} {rank:>5} {base:>11.3f} {split:>17.3f} {split / base:>10.1f}x "
            f"{byte_ratio:>25.1%} {mac_ratio:>23.2%}"
        )
    print(f"threads: {torch.get_num_threads()}; the pair is computed in float32 on the CPU at load")


if __name__ == "__main__":
    main()
