"""NVFP4 -> MXFP4 requantization speed and memory, next to BF16 -> MXFP4 quantization in the same run.

    python bench/requant.py [--shape 13824 5120] [--rules floor even rceil mse] [--repeats 3] [--threads N]
                            [--load [--rounds 3] [--blocks 1] [--dim 5120 --ffn 13824] [--load-rules floor mse] [--dir DIR]]

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

``--load`` measures the two load paths instead (both real paths read a file): it writes ``--blocks``
Wan2.2-A14B-sized blocks (attn1 / attn2 to_q, to_k, to_v, to_out.0 of 5120 x 5120, ffn.net.0.proj
13824 x 5120, ffn.net.2 5120 x 13824: 351M weights a block) to safetensors twice, in BF16 and in
ModelOpt's NVFP4 layout (``quantize_nvfp4``, ``hf_quant_config.json``), then, each path in a fresh
process, reads the file with ``safe_open`` as vLLM's loader does and produces the final MXFP4
parameters through the library: BF16 into online ``mxfp4`` Linears (``weight_loader``, then
``process_weights_after_loading``); NVFP4 through the plan the engine builds (``plan_nvfp4_expert``),
offline Linears built under it, :func:`~vllm_omni_mxfp4.hooks.nvfp4_loading.convert_stream` on the
tensor stream, ``weight_loader`` and ``process_weights_after_loading``, per rule. The files are in
the page cache (just written, and read once by the first run). The first run samples anonymous RSS
(file-backed pages of the mapped checkpoint are page cache, not counted): peak extra = peak above
the start minus the final parameters, against one layer in float32. Then best of ``--repeats``
runs, by process CPU time and by wall time. The paths take turns, ``--rounds`` times (a fresh
process each), and each keeps its best round: a shared runner's slow spells (CPU time swings by
a third here) then hit every path alike instead of whichever ran during them. The loader's value checks are not run on either path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm_omni_mxfp4 import spec
from vllm_omni_mxfp4.formats import quantize_mx
from vllm_omni_mxfp4.formats.nvfp4 import quantize_nvfp4
from vllm_omni_mxfp4.formats.requant import REQUANT_RULES
from vllm_omni_mxfp4.kernels.requant import requantize_nvfp4


class PeakRss:
    """Peak resident memory above the level at entry, sampled every millisecond in a thread
    (``read``: the process's RSS unless given)."""

    def __init__(self, read: Callable[[], int] | None = None) -> None:
        self._read = read or (lambda: psutil.Process().memory_info().rss)

    def __enter__(self) -> PeakRss:
        self.base = self._read()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._read())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._read())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def measure(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, int]]:
    """name -> (best CPU seconds, largest peak extra RSS in bytes) of each of ``fns`` over
    ``repeats`` runs after a warm-up, the functions taking turns (a slow spell of the shared
    runner then hits all of them). CPU time of this process, best of the runs: other jobs on
    shared cores inflate wall time, not that. Each requantization run builds its own lookup
    tables, so they are counted."""
    for fn in fns.values():
        fn()
    best = {name: (float("inf"), 0) for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            with PeakRss() as rss:
                start = time.process_time()
                result = fn()
                elapsed = time.process_time() - start
                del result
            t, extra = best[name]
            best[name] = (min(t, elapsed), max(extra, rss.extra))
    return best


# ------------------------------------------------------------------------------ load level


def block_layers(dim: int = 5120, ffn: int = 13824) -> list[tuple[str, int, int]]:
    """(checkpoint layer, out_features, in_features) of one Wan2.2 block (diffusers names); the
    defaults are Wan2.2-A14B's."""
    attn = [(f"{a}.{p}", dim, dim) for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")]
    return [*attn, ("ffn.net.0.proj", ffn, dim), ("ffn.net.2", dim, ffn)]


MODELOPT_NVFP4 = {
    "producer": {"name": "modelopt"},
    "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": []},
}


def write_checkpoints(root: Path, layers: list[tuple[str, int, int]], blocks: int) -> tuple[Path, Path]:
    """``root/bf16/transformer`` and ``root/nvfp4/transformer``: the same random weights (one file a
    block), in BF16 and in ModelOpt's NVFP4 export layout (packed E2M1 codes, E4M3 ``weight_scale``,
    float32 ``weight_scale_2`` per tensor, a static ``input_scale``, ``hf_quant_config.json``)."""
    dirs = root / "bf16" / "transformer", root / "nvfp4" / "transformer"
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
    (dirs[1] / "hf_quant_config.json").write_text(json.dumps(MODELOPT_NVFP4))
    g = torch.Generator().manual_seed(0)
    for b in range(blocks):
        bf16, nvfp4 = {}, {}
        for layer, n, k in layers:
            name = f"blocks.{b}.{layer}"
            w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
            nv = quantize_nvfp4(w, name=name)
            bf16[f"{name}.weight"] = w
            nvfp4.update({
                f"{name}.weight": nv.codes, f"{name}.weight_scale": nv.scales,
                f"{name}.weight_scale_2": nv.global_scale, f"{name}.input_scale": torch.ones(()),
            })  # fmt: skip
        save_file(bf16, str(dirs[0] / f"model-{b:05d}.safetensors"))
        save_file(nvfp4, str(dirs[1] / f"model-{b:05d}.safetensors"))
    return dirs


def read_stream(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``directory``'s safetensors files, read with ``safe_open`` as vLLM's loader does."""
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield key, f.get_tensor(key)


def build_linears(
    ctx: Callable, spec: dict, names: list[tuple[str, int, int]], plan: Any = None
) -> dict[str, torch.nn.Module]:
    """Checkpoint layer -> a vLLM Linear built with ``spec``'s config (carrying the NVFP4 ``plan`` as a
    route override, as the expert's build does) and the runtime name's prefix (its route), as the
    model's constructor would build it."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    from vllm_omni_mxfp4.hooks.nvfp4_loading import runtime_name
    from vllm_omni_mxfp4.omni import build_quant_config
    from vllm_omni_mxfp4.omni.routes import with_override

    qc = build_quant_config(spec)
    if plan is not None:
        qc = with_override(qc, plan)
    with ctx():
        return {
            name: ColumnParallelLinear(
                k, n, bias=False, quant_config=qc, prefix=runtime_name(name),
                params_dtype=torch.bfloat16, return_bias=False,
            )
            for name, n, k in names
        }  # fmt: skip


def load_into(ctx: Callable, linears: dict[str, torch.nn.Module], stream: Iterable) -> None:
    """Each tensor through its parameter's ``weight_loader``, then ``process_weights_after_loading``."""
    with ctx():
        for key, tensor in stream:
            layer, _, param = key.rpartition(".")
            target = getattr(linears[layer], param)
            target.weight_loader(target, tensor)
        for linear in linears.values():
            linear.quant_method.process_weights_after_loading(linear)


def runtime_tree(linears: dict[str, torch.nn.Module]) -> torch.nn.Module:
    """A module whose submodule at each layer's runtime path (``attn1.to_qkv``, ``ffn.net_0.proj``)
    is that layer's Linear, where ``convert_stream`` looks a layer's target up."""
    from vllm_omni_mxfp4.hooks.nvfp4_loading import runtime_name

    root = torch.nn.Module()
    for name, linear in linears.items():
        *parents, leaf = runtime_name(name).split(".")
        node = root
        for part in parents:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        if not hasattr(node, leaf):
            node.add_module(leaf, linear)
    return root


def load_path(
    ctx: Callable, root: Path, path: str, layers: list[tuple[str, int, int]], blocks: int
) -> tuple[Callable, Callable]:
    """``(prepare, load)`` for ``path`` (``bf16`` or ``nvfp4:RULE``): ``prepare()`` builds the
    Linears as the model's constructor does (not timed), ``load(prepared)`` reads the file and
    produces the final MXFP4 parameters, returning the Linears."""
    from types import SimpleNamespace

    from vllm_omni_mxfp4.hooks.nvfp4_loading import PLAN_ATTR, convert_stream, plan_nvfp4_expert
    from vllm_omni_mxfp4.omni import build_quant_config

    names = [(f"blocks.{b}.{layer}", n, k) for b in range(blocks) for layer, n, k in layers]
    spec = {"method": "mxfp4", "backend": "emulated"}
    if path == "bf16":
        directory = root / "bf16" / "transformer"

        def load_bf16(linears: dict) -> dict:
            load_into(ctx, linears, read_stream(directory))
            return linears

        return lambda: build_linears(ctx, spec, names), load_bf16
    spec["nvfp4_requant_rule"] = path.partition(":")[2]
    od = SimpleNamespace(model=str(root / "nvfp4"), quantization_config=build_quant_config(spec))

    def prepare() -> tuple:
        plan = plan_nvfp4_expert(od, "transformer")  # detection: what the engine does before building
        linears = build_linears(ctx, spec, names, plan)
        model = runtime_tree(linears)
        setattr(model, PLAN_ATTR, plan)  # as the wrapped _create_transformer marks the built expert
        return plan, linears, model

    def load_nvfp4(prepared: tuple) -> dict:
        plan, linears, model = prepared
        load_into(ctx, linears, convert_stream(model, read_stream(plan.directory)))
        requantized = sum(r["action"] == "requantize" for r in plan.records)
        if requantized != len(linears):
            raise RuntimeError(f"{requantized} of {len(linears)} layers requantized: {plan.summary()}")
        return linears

    return prepare, load_nvfp4


def anon_rss() -> int:
    """Anonymous resident memory of this process (RSS minus file-backed and shared pages: the mapped
    checkpoint files are page cache, which the kernel reclaims)."""
    info = psutil.Process().memory_info()
    return info.rss - info.shared


def load_child(root: Path, path: str, layers: list[tuple[str, int, int]], blocks: int, repeats: int) -> None:
    """One load path in this (fresh) process: a first run sampling memory, then ``repeats`` timed runs;
    prints one JSON line."""
    os.environ["VLLM_OMNI_MXFP4_EMULATED_CACHE"] = "0"  # packed weights only, as the memory bench loads
    from linear import init_vllm  # bench/linear.py: vLLM-Omni configs and a TP=1 group

    ctx = init_vllm()
    prepare, load = load_path(ctx, root, path, layers, blocks)
    prepared = prepare()
    with PeakRss(anon_rss) as rss:
        linears = load(prepared)
    final = sum(t.numel() * t.element_size() for m in linears.values() for t in m.state_dict().values())
    del linears, prepared
    cpu, wall = [], []
    for _ in range(repeats):
        prepared = prepare()
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        load(prepared)
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start_wall)
        del prepared
    result = {"path": path, "cpu_s": min(cpu), "wall_s": min(wall), "peak_above_start": rss.extra}
    print(json.dumps({**result, "final_bytes": final, "threads": torch.get_num_threads()}))


def compute(args: argparse.Namespace) -> None:
    """The compute-only table: requantize_nvfp4 per rule next to quantize_mx, in memory."""
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
    fns = {"quantize_mx bf16 (floor)": lambda: quantize_mx(w, scale_rule="floor")}
    fns.update(
        {f"requantize_nvfp4 ({rule})": lambda rule=rule: requantize_nvfp4(nv, rule) for rule in args.rules}
    )
    best = measure(fns, args.repeats)
    rows = [(name, *best[name]) for name in fns]
    base_t = rows[0][1]
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


def run_child(args: argparse.Namespace, root: Path, path: str) -> dict:
    """One load path measured in a fresh process (its own memory and page-cache-warm reads)."""
    command = [
        sys.executable,
        __file__,
        "--load-child",
        path,
        "--dir",
        str(root),
        "--blocks",
        str(args.blocks),
    ]
    command += ["--dim", str(args.dim), "--ffn", str(args.ffn), "--repeats", str(args.repeats)] + (
        ["--threads", str(args.threads)] if args.threads else []
    )
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"load path {path} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def best_of(a: dict, b: dict) -> dict:
    """Two rounds of one load path: the least CPU and wall time, the largest memory peak."""
    return {
        **a,
        "cpu_s": min(a["cpu_s"], b["cpu_s"]),
        "wall_s": min(a["wall_s"], b["wall_s"]),
        "peak_above_start": max(a["peak_above_start"], b["peak_above_start"]),
    }


def load_level(args: argparse.Namespace, root: Path) -> None:
    """The load-level table: each path from its file to the final MXFP4 parameters; targets checked."""
    layers = block_layers(args.dim, args.ffn)
    weights = args.blocks * sum(n * k for _, n, k in layers)
    budget = args.ffn * args.dim * 4  # one float32 ffn.net.0.proj
    start = time.perf_counter()
    dirs = write_checkpoints(root, layers, args.blocks)
    sizes = [sum(f.stat().st_size for f in d.glob("*.safetensors")) for d in dirs]
    print(f"wrote {args.blocks} Wan2.2 block(s) of {args.dim} / {args.ffn}, {weights / 1e6:.0f}M weights, in {time.perf_counter() - start:.0f} s: "
          f"BF16 {sizes[0] / 1e6:.0f} MB, NVFP4 {sizes[1] / 1e6:.0f} MB (in the page cache)")  # fmt: skip
    paths = ["bf16", *(f"nvfp4:{r}" for r in args.load_rules)]
    rows = [run_child(args, root, path) for path in paths]
    for _ in range(args.rounds - 1):  # turns: every path again, each keeping its best
        for i, path in enumerate(paths):
            rows[i] = best_of(rows[i], run_child(args, root, path))
    header = f"{'load path':<16} {'CPU s':>7} {'wall s':>7} {'Mw/CPU s':>9} {'Mw/wall s':>10} {'x bf16 CPU':>11} {'x bf16 wall':>12} {'peak extra MB':>14} {'/ fp32 layer':>13}"
    print(
        f"threads {rows[0]['threads']}; final MXFP4 parameters {rows[0]['final_bytes'] / 1e6:.0f} MB; "
        f"best of {args.rounds} round(s) x {args.repeats} run(s) per path"
    )
    print(header + "\n" + "-" * len(header))
    base, verdicts = rows[0], []
    for r in rows:
        extra = r["peak_above_start"] - r["final_bytes"]
        x_cpu, x_wall = base["cpu_s"] / r["cpu_s"], base["wall_s"] / r["wall_s"]
        print(f"{r['path']:<16} {r['cpu_s']:7.2f} {r['wall_s']:7.2f} {weights / r['cpu_s'] / 1e6:9.1f} "
              f"{weights / r['wall_s'] / 1e6:10.1f} {x_cpu:11.2f} {x_wall:12.2f} {extra / 1e6:14.0f} {extra / budget:13.2f}")  # fmt: skip
        verdicts.append(
            f"{r['path']}: peak extra {extra / 1e6:.0f} MB <= {budget / 1e6:.0f} MB: {'ok' if extra <= budget else 'MISSED'}"
        )
        if r is not base:
            ok = "ok" if min(x_cpu, x_wall) >= 1 else "MISSED"
            verdicts.append(
                f"{r['path']}: throughput >= online BF16 -> MXFP4 (CPU {x_cpu:.2f}x, wall {x_wall:.2f}x): {ok}"
            )
    print("targets:\n  " + "\n  ".join(verdicts))
    print(
        "peak extra = anonymous RSS peak above the start minus the final parameters (the checkpoint's mapped pages are page cache, not counted)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", type=int, nargs=2, default=[13824, 5120], metavar=("N", "K"))
    parser.add_argument("--rules", nargs="+", default=list(REQUANT_RULES), choices=REQUANT_RULES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--load", action="store_true", help="also measure the load paths from files")
    parser.add_argument("--blocks", type=int, default=1, help="Wan2.2-A14B-sized blocks for --load")
    parser.add_argument(
        "--rounds", type=int, default=3, help="--load: turns of all paths, each path keeping its best"
    )
    parser.add_argument(
        "--dim", type=int, default=5120, help="--load blocks' model width (Wan2.2-A14B: 5120)"
    )
    parser.add_argument(
        "--ffn", type=int, default=13824, help="--load blocks' FFN width (Wan2.2-A14B: 13824)"
    )
    parser.add_argument("--load-rules", nargs="+", default=["floor", "mse"], choices=REQUANT_RULES)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where --load writes its files (default: a temp dir)"
    )
    parser.add_argument("--load-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.load_child:
        load_child(args.dir, args.load_child, block_layers(args.dim, args.ffn), args.blocks, args.repeats)
        return
    compute(args)
    if args.load:
        print()
        if args.dir is not None:
            load_level(args, args.dir)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                load_level(args, Path(tmp))


if __name__ == "__main__":
    main()
