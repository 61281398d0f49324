"""Merge throughput and memory on a synthetic two-expert export, next to a plain copy of the same files.

    python bench/merge.py [--dim 3072] [--ffn 8192] [--blocks 6] [--workdir DIR] [--keep]

It writes, in a temporary directory, a BF16 diffusers Wan2.2 T2V pipeline (two transformers, sharded
like the hub checkpoints) and a matching msModelSlim W4A4_MXFP4_DUALSCALE export in original Wan
naming (MindIE saver layout: half the blocks quantized with Smooth on the self-attention, half kept
FLOAT). With the defaults the export is 2.28 GB and the originals 3.38 GB. Then, in the same run:

1. copies every input file the merge reads (export + original) to a scratch directory and times it;
2. runs ``vllm-omni-mxfp4 merge`` in a child process and times it, and takes the child's peak RSS.

It prints the merge throughput as a ratio to the copy (same input bytes; the merge also validates the
scales, reads less and writes less) and the peak RSS next to the largest single tensor. Targets: the
ratio at least 0.5, and peak RSS under 2 x largest tensor + 300 MB. Everything is deleted at the end
unless ``--keep``. Both timings start after ``os.sync()`` and end when their output is on disk. The
inputs were just written, so both read them from the page cache; the copy writes 2.5x more than the
merge and, on a small machine, hits the kernel's dirty-page throttling (writeback speed) where the
merge does not: the ratio measures that difference too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from vllm_omni_mxfp4.config.keys import layer_order
from vllm_omni_mxfp4.models.wan import diffusers_to_wan, parse_diffusers
from vllm_omni_mxfp4.safetensors_io import OutputTensor, split_into_shards, write_checkpoint

CHUNK = 8 * 1024 * 1024
_RANDOM = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


def finite_bf16(seed: int) -> bytes:
    """A CHUNK of random finite bf16 values: the merge refuses NaN/Inf in unquantized tensors, and
    tells the experts apart by their unquantized tensors, so each expert gets its own seed."""
    values = np.random.default_rng(seed).standard_normal(CHUNK // 2).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


EXPERT_PATTERNS = (finite_bf16(1), finite_bf16(2))


@dataclass(frozen=True)
class Fill:
    """``nbytes`` of a repeated pattern (random bytes by default)."""

    nbytes: int
    pattern: bytes = b""

    def write_to(self, out: BinaryIO, progress) -> None:
        block = _RANDOM if not self.pattern else self.pattern * (CHUNK // len(self.pattern))
        remaining = self.nbytes
        while remaining:
            view = memoryview(block)[: min(remaining, len(block))]
            while view:
                view = view[out.write(view) :]
            remaining -= min(remaining, len(block))
        progress(self.nbytes)


BF16_ONE = b"\x80\x3f"
F32_SMALL = np.float32(0.01).tobytes()
E8M0_120 = bytes([120])


def diffusers_tensors(dim: int, ffn: int, blocks: int) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of a BF16 diffusers WanTransformer3DModel."""
    text_dim, freq_dim, channels = 4096, 256, 16
    linears = {
        "condition_embedder.time_embedder.linear_1": (dim, freq_dim),
        "condition_embedder.time_embedder.linear_2": (dim, dim),
        "condition_embedder.time_proj": (6 * dim, dim),
        "condition_embedder.text_embedder.linear_1": (dim, text_dim),
        "condition_embedder.text_embedder.linear_2": (dim, dim),
        "proj_out": (channels * 4, dim),
    }
    for b in range(blocks):
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                linears[f"blocks.{b}.{attn}.{proj}"] = (dim, dim)
            for norm in ("norm_q", "norm_k"):
                yield f"blocks.{b}.{attn}.{norm}.weight", "BF16", (dim,)
        linears[f"blocks.{b}.ffn.net.0.proj"] = (ffn, dim)
        linears[f"blocks.{b}.ffn.net.2"] = (dim, ffn)
        yield f"blocks.{b}.norm2.weight", "BF16", (dim,)
        yield f"blocks.{b}.norm2.bias", "BF16", (dim,)
        yield f"blocks.{b}.scale_shift_table", "BF16", (1, 6, dim)
    for layer, shape in linears.items():
        yield f"{layer}.weight", "BF16", shape
        yield f"{layer}.bias", "BF16", (shape[0],)
    yield "patch_embedding.weight", "BF16", (dim, channels, 1, 2, 2)
    yield "patch_embedding.bias", "BF16", (dim,)
    yield "scale_shift_table", "BF16", (1, 2, dim)


def _out(name: str, dtype: str, shape: tuple[int, ...], pattern: bytes = b"") -> OutputTensor:
    size = {"BF16": 2, "F32": 4, "U8": 1}[dtype]
    return OutputTensor(name, dtype, shape, Fill(math.prod(shape) * size, pattern))


def build(root: Path, dim: int, ffn: int, blocks: int) -> tuple[Path, Path, int]:
    """Write the original pipeline and the export; returns (original, quant, largest tensor bytes)."""
    original, quant = root / "Wan2.2-T2V-synthetic-Diffusers", root / "msmodelslim-output"
    tensors = list(diffusers_tensors(dim, ffn, blocks))
    largest = max(math.prod(shape) * 2 for _, _, shape in tensors)
    index = {"_class_name": "WanPipeline", "boundary_ratio": 0.875}
    experts = (("transformer", "high_noise_model"), ("transformer_2", "low_noise_model"))
    for (folder, expert), bf16 in zip(experts, EXPERT_PATTERNS):
        index[folder] = ["diffusers", "WanTransformer3DModel"]
        tdir = original / folder
        tdir.mkdir(parents=True)
        config = {"_class_name": "WanTransformer3DModel", "num_layers": blocks, "ffn_dim": ffn}
        (tdir / "config.json").write_text(json.dumps(config))
        outs = [_out(n, d, s, bf16) for n, d, s in tensors]
        write_checkpoint(
            tdir, "diffusion_pytorch_model", split_into_shards(outs, 10**9, layer_order), lambda n: None
        )

        edir = quant / expert
        edir.mkdir(parents=True)
        export, labels = [], {}
        for name, dtype, shape in tensors:
            wan = diffusers_to_wan(name)
            place = parse_diffusers(name)
            if place.kind != "linear" or place.block is None or place.block % 2 == 0:
                export.append(_out(wan, dtype, shape, bf16))
                labels[wan] = "FLOAT"
                continue
            layer = wan.rsplit(".", 1)[0]
            smooth = ".self_attn." in layer and not layer.endswith(".o")
            prefix = f"{layer}.linear" if smooth else layer
            if name.endswith(".bias"):
                export.append(_out(f"{prefix}.bias", "F32", shape, F32_SMALL))
                labels[f"{prefix}.bias"] = "FLOAT"
                continue
            n, k = shape
            label = "W4A4_MXFP4_DUALSCALE"
            for leaf, dt, sh, pattern in (
                ("weight", "U8", (n, k // 2), b""),
                ("weight_scale", "U8", (n, math.ceil(k / 32)), E8M0_120),
                ("weight_dual_scale", "F32", (n, math.ceil(k / 512), 1), F32_SMALL),
            ):
                export.append(_out(f"{prefix}.{leaf}", dt, sh, pattern))
                labels[f"{prefix}.{leaf}"] = label
            if smooth:
                export.append(_out(f"{layer}.div.mul_scale", "BF16", (k,), BF16_ONE))
                labels[f"{layer}.div.mul_scale"] = "FLOAT"
        labels["model_quant_type"] = "W4A4_MXFP4_DUALSCALE"
        write_checkpoint(
            edir,
            "quant_model_weight_w4a4_mxfp4_dualscale",
            split_into_shards(export, None, layer_order),
            lambda n: None,
        )
        (edir / "quant_model_description_w4a4_mxfp4_dualscale.json").write_text(json.dumps(labels, indent=4))
    (original / "model_index.json").write_text(json.dumps(index))
    for component in ("vae", "text_encoder", "tokenizer", "scheduler"):
        (original / component).mkdir()
        (original / component / "config.json").write_text(json.dumps({"_class_name": component}))
    return original, quant, largest


def _mem_available() -> int:
    with open("/proc/meminfo") as fh:
        fields = dict(line.split(":", 1) for line in fh)
    return int(fields["MemAvailable"].split()[0]) * 1024


def _size(paths: list[Path]) -> int:
    return sum(p.stat().st_size for root in paths for p in root.rglob("*") if p.is_file())


def synced(fn):
    """``fn()`` and the seconds from its start until its writes are on disk (``os.sync``)."""
    start = time.perf_counter()
    result = fn()
    os.sync()
    return result, time.perf_counter() - start


def copy_tree(sources: list[Path], dest: Path) -> float:
    start = time.perf_counter()
    for src in sources:
        shutil.copytree(src, dest / src.name)
    return time.perf_counter() - start


def run_merge(original: Path, quant: Path, out: Path, *extra: str) -> tuple[float, int, dict]:
    """Time the CLI in a child process; returns (seconds, peak RSS bytes, JSON report)."""
    cmd = [sys.executable, "-m", "vllm_omni_mxfp4.cli", "merge", "--model-type", "Wan2.2-T2V-A14B", *extra]
    cmd += [
        "--original-model",
        str(original),
        "--quant-path",
        str(quant),
        "--output-path",
        str(out),
        "--json",
    ]
    start = time.perf_counter()
    with tempfile.TemporaryFile() as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        text = stdout.read().decode()
    if proc.returncode != 0:
        raise SystemExit(f"merge failed ({proc.returncode}): {text[-2000:]}")
    return seconds, usage.ru_maxrss * 1024, json.loads(text)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dim", type=int, default=3072)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--blocks", type=int, default=6, help="blocks per expert; the odd ones are quantized")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mxfp4-merge-bench-", dir=args.workdir))
    try:
        start = time.perf_counter()
        original, quant, largest = build(root / "in", args.dim, args.ffn, args.blocks)
        export_bytes, original_bytes = _size([quant]), _size([original])
        print(
            f"synthetic export {export_bytes / 1e9:.2f} GB, original {original_bytes / 1e9:.2f} GB, "
            f"largest tensor {largest / 1e6:.1f} MB (built in {time.perf_counter() - start:.1f} s); "
            f"{_mem_available() / 1e9:.1f} GB of memory available"
        )
        inputs = export_bytes + original_bytes
        # The merge derives the runtime names from vLLM-Omni's class once per class and config (a
        # child process that imports vLLM-Omni; cached on disk): measured apart, with a cold cache,
        # by a --dry-run, which leaves the cache warm for the timed merge below.
        os.environ["VLLM_OMNI_MXFP4_CACHE"] = str(root / "cache")
        t_names, rss_names, _ = run_merge(original, quant, root / "dry", "--dry-run")
        print(
            f"names from vLLM-Omni's class (cold cache, --dry-run): {t_names:.2f} s, peak RSS "
            f"{rss_names / 1e6:.0f} MB; paid once per class and config, whatever the model's size"
        )
        os.sync()  # neither run pays for the other's (or the build's) dirty pages
        t_copy, t_copy_synced = synced(lambda: copy_tree([original, quant], root / "copy"))
        shutil.rmtree(root / "copy")
        os.sync()
        (t_merge, rss, report), t_merge_synced = synced(lambda: run_merge(original, quant, root / "merged"))
        out_bytes = _size([root / "merged"])
        moved = sum(t["bytes_in"] for t in report["transformers"]) + out_bytes
        print(f"{'':<6} {'seconds':>8} {'+ sync':>8} {'input GB/s':>11} {'read+write GB/s':>16}")
        for name, t, t_sync, rw in (
            ("copy", t_copy, t_copy_synced, 2 * inputs),
            ("merge", t_merge, t_merge_synced, moved),
        ):
            print(f"{name:<6} {t:8.2f} {t_sync:8.2f} {inputs / t_sync / 1e9:11.2f} {rw / t_sync / 1e9:16.2f}")
        ratio = t_copy_synced / t_merge_synced
        limit = 2 * largest + 300e6
        print(
            f"merge throughput / copy throughput (same {inputs / 1e9:.2f} GB of inputs, until on disk): {ratio:.2f} "
            f"(target >= 0.50: {'ok' if ratio >= 0.5 else 'MISSED'})"
        )
        print(
            f"merge peak RSS (names cached) {rss / 1e6:.0f} MB; largest tensor {largest / 1e6:.1f} MB; "
            f"limit 2 x largest + 300 MB = {limit / 1e6:.0f} MB ({'ok' if rss < limit else 'MISSED'})"
        )
        print(f"merge output {out_bytes / 1e9:.2f} GB; the merge's own timer: {report['seconds']:.2f} s")
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
