"""Emulated W4A4 Linear speed and online-loading memory, against BF16 in the same run.

    python bench/linear.py [--tokens 1024] [--features 4096] [--repeats 7] [--memory-blocks 2]
                           [--dim 5120 --ffn 13824]

1. Speed: an emulated ``mxfp4`` Linear (vLLM ``ColumnParallelLinear`` with our method, the real
   forward path) of [tokens x K] x [K x N] in bf16, next to bf16 ``F.linear`` on the same weights,
   with the dequantized weight cached (default) and with the weight kept packed. Prints the time
   ratio to bf16.
2. Memory: peak RSS of building and loading a stack of Wan2.2-A14B-sized blocks (dim 5120, FFN
   13824: 8 Linears, 351M parameters a block; ``--dim`` / ``--ffn`` set other widths) online as
   ``mxfp4`` (packed weights) versus BF16, each in a fresh process. Weights are generated one layer
   at a time, as a streaming loader reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def wan_block(dim: int = 5120, ffn: int = 13824) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of one Wan2.2 transformer block; the defaults are Wan2.2-A14B's."""
    return [
        ("attn1.to_qkv", 3 * dim, dim),
        ("attn1.to_out", dim, dim),
        ("attn2.to_q", dim, dim),
        ("attn2.to_k", dim, dim),
        ("attn2.to_v", dim, dim),
        ("attn2.to_out", dim, dim),
        ("ffn.net_0.proj", ffn, dim),
        ("ffn.net_2", dim, ffn),
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_vllm():
    """vLLM-Omni configs and a TP=1 gloo group, as the diffusion worker sets them up."""
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

    from vllm_omni_mxfp4.plugin import register

    register()
    od = OmniDiffusionConfig(model=None, dtype=torch.bfloat16, num_gpus=1)
    vcfg = create_diffusion_vllm_config(torch.device("cpu"), od)
    ctx = context(od, vcfg)
    with ctx():
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            backend="gloo",
        )
        initialize_model_parallel(
            tensor_parallel_size=1, data_parallel_size=1, sequence_parallel_size=1, backend="gloo"
        )
    return ctx


def context(od, vcfg):
    import contextlib

    from vllm.config.vllm import set_current_vllm_config
    from vllm_omni.diffusion.forward_context import set_forward_context

    @contextlib.contextmanager
    def ctx():
        with set_forward_context(vllm_config=vcfg, omni_diffusion_config=od), set_current_vllm_config(vcfg):
            yield

    return ctx


def make_linear(ctx, spec, n, k):
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    from vllm_omni_mxfp4.omni import build_quant_config

    with ctx():
        return ColumnParallelLinear(
            k,
            n,
            bias=False,
            quant_config=build_quant_config(spec) if spec else None,
            prefix="blocks.0.attn2.to_q",
            params_dtype=torch.bfloat16,
            return_bias=False,
        )


def timed(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def speed(args) -> None:
    ctx = init_vllm()
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(args.features, args.features, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(args.tokens, args.features, generator=g).to(torch.bfloat16)
    t_bf16 = timed(lambda: F.linear(x, w), args.repeats)
    print(
        f"Linear [{args.tokens} x {args.features}] x [{args.features} x {args.features}] bf16, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"  bf16 F.linear                      {t_bf16 * 1e3:8.2f} ms   1.00x")
    for cache in (True, False):
        # The emulated kernel reads its options when a config builds it (here: make_linear).
        os.environ["VLLM_OMNI_MXFP4_EMULATED_CACHE"] = "1" if cache else "0"
        layer = make_linear(ctx, {"method": "mxfp4", "backend": "emulated"}, args.features, args.features)
        layer.weight.weight_loader(layer.weight, w)
        with ctx():
            layer.quant_method.process_weights_after_loading(layer)

        def run(layer=layer):
            with torch.no_grad():
                return layer(x)

        t = timed(run, args.repeats)
        name = "emulated W4A4, cached bf16 weight" if cache else "emulated W4A4, packed weight"
        print(f"  {name:<34} {t * 1e3:8.2f} ms   {t / t_bf16:.2f}x")


def memory_child(mode: str, blocks: int, dim: int, ffn: int) -> None:
    """Build and load ``blocks`` Wan2.2 blocks of ``dim`` / ``ffn``; print peak RSS (run in a fresh process)."""
    ctx = init_vllm()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    spec = None if mode == "bf16" else {"method": "mxfp4", "backend": "emulated"}
    if mode == "mxfp4":
        os.environ["VLLM_OMNI_MXFP4_EMULATED_CACHE"] = "0"
    layers = []
    largest = 0
    g = torch.Generator().manual_seed(0)
    for _ in range(blocks):
        for _name, n, k in wan_block(dim, ffn):
            layer = make_linear(ctx, spec, n, k)
            w = torch.randn(n, k, generator=g, dtype=torch.bfloat16)
            largest = max(largest, w.numel() * 2)
            layer.weight.weight_loader(layer.weight, w)
            del w
            layers.append(layer)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
    print(
        json.dumps(
            {"mode": mode, "peak_above_start": peak - base, "held": held, "largest_bf16_layer": largest}
        )
    )


def memory(args) -> None:
    results = {}
    for mode in ("bf16", "mxfp4"):
        out = subprocess.run(
            [sys.executable, __file__, "--memory-child", mode, "--memory-blocks", str(args.memory_blocks)]
            + ["--dim", str(args.dim), "--ffn", str(args.ffn)],
            capture_output=True,
            text=True,
            check=True,
        )
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    gib = 2**30
    size = (
        "Wan2.2-A14B-sized" if (args.dim, args.ffn) == (5120, 13824) else f"Wan2.2 ({args.dim} / {args.ffn})"
    )
    print(f"\nLoading {args.memory_blocks} {size} block(s) ({len(wan_block())} Linears each):")
    for mode, r in results.items():
        print(
            f"  {mode:<6} weights held {r['held'] / gib:6.2f} GiB, peak RSS above start "
            f"{r['peak_above_start'] / gib:6.2f} GiB"
        )
    q, b = results["mxfp4"], results["bf16"]
    # Blocks smaller than what importing vLLM allocated may not raise the peak at all.
    ratio = f"{q['peak_above_start'] / b['peak_above_start']:.2f}" if b["peak_above_start"] > 0 else "n/a"
    print(
        f"  online mxfp4 peak / bf16 peak = {ratio}; "
        f"mxfp4 peak - held = {(q['peak_above_start'] - q['held']) / gib:.2f} GiB "
        f"(largest BF16 layer {q['largest_bf16_layer'] / gib:.2f} GiB)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--features", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--memory-blocks", type=int, default=2)
    parser.add_argument(
        "--dim", type=int, default=5120, help="memory blocks' model width (Wan2.2-A14B: 5120)"
    )
    parser.add_argument(
        "--ffn", type=int, default=13824, help="memory blocks' FFN width (Wan2.2-A14B: 13824)"
    )
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--memory-child", choices=["bf16", "mxfp4"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child, args.memory_blocks, args.dim, args.ffn)
        return
    speed(args)
    if not args.skip_memory:
        memory(args)
    print("\nSummary: ratios are emulated time / bf16 time measured in this run; memory is peak RSS.")


if __name__ == "__main__":
    main()
