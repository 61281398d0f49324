"""The ``vllm-omni-mxfp4`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MERGE_DESCRIPTION = """\
Merge msModelSlim W4A4 MXFP4 output (W4A4_MXFP4 or W4A4_MXFP4_DUALSCALE, either saver, sharded or not)
into a copy of the original BF16 diffusers Wan2.2 pipeline. The quantized transformers get diffusers
tensor names, the quantized tensors overlaid on the BF16 original, and a quantization_config in
config.json, so vLLM-Omni loads the result with no --quantization flag. Everything is validated
before anything is written; the output is built beside the target and renamed into place at the
end, so a failure or an interruption leaves no output directory.

Exit status: 0 success, 2 usage or validation error, 1 I/O error, 128 + the signal's number for
SIGINT (130), SIGHUP (129), SIGQUIT (131) and SIGTERM (143). A SIGKILL cannot be caught: it leaves a
staging directory, which the next merge (to any target) removes and --dry-run reports."""

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5 * 10**9, ``"512MiB"`` -> 512 * 2**20, ``"1000"`` -> 1000 bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}; use e.g. 5GB, 500MB, 512MiB or a byte count"
        )
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; it must be positive")
    return size


def add_merge_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``merge`` (shared with tools/merge_mxfp4_dualscale_checkpoint.py)."""
    from .checkpoint import (
        AUTO,
        MODEL_TYPES,
        MXFP8_POLICIES,
        NON_BLOCK_POLICIES,
        UNSERVED_MODEL_TYPES,
        WEIGHT_LAYOUTS,
    )

    parser.add_argument(
        "--model-type",
        required=True,
        choices=[*MODEL_TYPES, *UNSERVED_MODEL_TYPES, AUTO],
        help="Model variant; two-expert types map high_noise_model -> transformer and low_noise_model -> "
        "transformer_2. 'auto' reads the original's model_index.json. HunyuanVideo is refused with the "
        "reason (msModelSlim's adapter quantizes HunyuanVideo 1.0, which vLLM-Omni does not serve).",
    )
    parser.add_argument("--original-model", required=True, help="Original BF16 diffusers pipeline directory.")
    parser.add_argument(
        "--quant-path",
        required=True,
        help="msModelSlim output directory (with high_noise_model/ and low_noise_model/ for two experts).",
    )
    parser.add_argument("--output-path", required=True, help="Merged pipeline directory to create.")
    parser.add_argument(
        "--weight-layout",
        choices=WEIGHT_LAYOUTS,
        default="packed",
        help="packed: uint8 (N, K/2) FP4 pairs, low nibble first (default; a quarter of numeric). "
        "numeric: the FP4 values as BF16 (N, K), for loaders that expect them.",
    )
    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="Shard each transformer's weights into files of at most SIZE (e.g. 5GB, 512MiB) plus "
        "diffusion_pytorch_model.safetensors.index.json. Default: one file.",
    )
    parser.add_argument(
        "--non-block-quantized",
        choices=NON_BLOCK_POLICIES,
        default="error",
        help="What to do with quantized Linears outside the transformer blocks (embedders, proj_out), which "
        "vLLM-Omni always runs in BF16: 'error' (default) or take them from the 'original' BF16 weights.",
    )
    parser.add_argument(
        "--mxfp8-layers",
        choices=MXFP8_POLICIES,
        default="keep",
        help="Linears the export stores as W8A8 MXFP8 (msModelSlim's Wan2.2 recipes: blocks 0-4): 'keep' "
        "(default) writes them as they are and lists them in mxfp8_layers; 'bf16' takes them from the "
        "original BF16 weights and lists them in ignored_layers (for backends without MXFP8, e.g. ROCm).",
    )
    parser.add_argument("--dry-run", action="store_true", help="Validate and report; write nothing.")
    parser.add_argument("--overwrite", action="store_true", help="Replace an existing output directory.")
    parser.add_argument("--json", action="store_true", help="Print a machine-readable JSON report instead.")


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def format_merge_summary(report) -> str:
    """The human-readable end-of-run summary of a :class:`~vllm_omni_mxfp4.checkpoint.MergeReport`."""
    head = "dry run, nothing written:" if report.dry_run else "merged"
    lines = [f"{head} {report.model_type} -> {report.output_path} ({report.weight_layout} weights)"]
    width = max(len(t.name) for t in report.transformers)
    for t in report.transformers:
        source = t.quant_dir.rsplit("/", 1)[-1]
        smooth = f", Smooth on {t.smooth_layers}" if t.smooth_layers else ""
        require = (
            ""
            if t.require_smooth_scale is None
            else f", require_smooth_scale={str(t.require_smooth_scale).lower()}"
        )
        lines.append(
            f"  {t.name:<{width}} <- {source}: {t.quant_method}, {t.layers_quantized} layers quantized, "
            f"{t.layers_bf16} kept BF16 ({len(t.ignored_layers)} ignored_layers){smooth}{require}; "
            f"{_human(t.bytes_in)} in, {_human(t.bytes_out)} out, {t.seconds:.2f} s"
        )
        if t.mxfp8_layers or t.mxfp8_to_bf16:
            lines.append(
                f"    W8A8 MXFP8: {len(t.mxfp8_layers)} layers kept (mxfp8_layers), "
                f"{len(t.mxfp8_to_bf16)} taken from the BF16 original"
            )
        if t.low_rank_layers:
            ranks = sorted(set(t.low_rank_layers.values()))
            lines.append(
                f"    low-rank pairs (svd_res): {len(t.low_rank_layers)} layers, rank "
                f"{'/'.join(map(str, ranks))} (svd_lowrank_layers)"
            )
        lines.extend(
            f"    attention {a}: FA3 {d} in the export, runs BF16" for a, d in t.fa3_attention.items()
        )
        lines.extend(f"    warning: {w}" for w in t.warnings)
    lines.append(
        f"  copied {report.copied_files} other pipeline files ({_human(report.copied_bytes)}); "
        f"total {report.seconds:.2f} s"
    )
    lines.extend(f"  removed {path}, left by a killed merge" for path in report.removed_stale)
    lines.extend(
        f"  stale: {path}, left by a killed merge; the next merge (without --dry-run) removes it"
        for path in report.stale_staging
    )
    return "\n".join(lines)


#: The signals a merge turns into a clean exit (staging removed, status 128 + the signal's number).
CLEAN_EXIT_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM)
_SIGNAL_WORDS = {signal.SIGINT: "interrupted", signal.SIGHUP: "hung up", signal.SIGQUIT: "quit"}


class _Stopped(BaseException):
    """Raised in the main thread by the first handled signal, so that the merge cleans up.

    A ``BaseException`` (like ``KeyboardInterrupt``), so no ``except Exception`` swallows it.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _SignalGuard:
    """While active, the first of :data:`CLEAN_EXIT_SIGNALS` raises :class:`_Stopped` in the main
    thread; later ones (a second Ctrl-C) are ignored, so that the cleanup the first one started runs
    to its end. A signal the parent set to be ignored (``nohup`` for SIGHUP, a background job's
    SIGINT) stays ignored."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            raise _Stopped(signum)

    def __enter__(self) -> _SignalGuard:
        for signum in CLEAN_EXIT_SIGNALS:
            previous = signal.getsignal(signum)
            if previous is not signal.SIG_IGN:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def run_guarded(
    args: argparse.Namespace, work: Callable[[], object], summary: Callable[[object], str]
) -> int:
    """Run ``work()`` (a merge or a convert, both writing through a staging directory) under the
    signal guard; print ``summary(report)``, ``report.to_dict()`` as JSON with ``args.json``, or the
    error; return the exit status: 0, 2 for a refusal (:class:`CheckpointError`), 1 for an I/O
    error, 128 + the signal's number for a handled signal. No output is left unless it returns 0."""
    from .checkpoint import CheckpointError

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")

    def fail(message: str, status: int) -> int:
        if args.json:
            print(json.dumps({"ok": False, "error": message}))
        else:
            print(f"error: {message}", file=sys.stderr)
        return status

    try:
        with _SignalGuard():
            report = work()
    except CheckpointError as exc:
        return fail(str(exc), 2)
    except KeyboardInterrupt:  # raised by code that runs its own SIGINT handling
        return fail("interrupted; no output was written", 128 + signal.SIGINT)
    except _Stopped as stop:
        word = _SIGNAL_WORDS.get(stop.signum, "terminated")
        return fail(f"{word} ({signal.Signals(stop.signum).name}); no output was written", 128 + stop.signum)
    except OSError as exc:
        return fail(f"{exc}; no output was written", 1)
    if args.json:
        print(json.dumps({"ok": True, **report.to_dict()}, indent=2))
    else:
        print(summary(report))
    return 0


def run_merge(args: argparse.Namespace) -> int:
    """Run ``merge`` for parsed arguments; prints the summary or the error; returns the exit status."""
    from .checkpoint import merge

    def work():
        return merge(
            args.model_type,
            args.original_model,
            args.quant_path,
            args.output_path,
            weight_layout=args.weight_layout,
            max_shard_size=args.max_shard_size,
            dry_run=args.dry_run,
            overwrite=args.overwrite,
            non_block_quantized=args.non_block_quantized,
            mxfp8_layers=args.mxfp8_layers,
        )

    return run_guarded(args, work, format_merge_summary)


CONVERT_DESCRIPTION = """\
Convert an NVFP4 diffusers checkpoint (ModelOpt, compressed-tensors or Comfy/BFL layout) into an
offline MXFP4 one that vLLM-Omni auto-detects (quant_method mxfp4, packed uint8 weight + E8M0
weight_scale). INPUT is a pipeline directory (each NVFP4 component converted, every other file
copied byte for byte) or one transformer directory with its diffusers config.json. Each NVFP4 block
Linear is dequantized exactly and requantized per 32-block under --scale-rule; producer excludes
stay as stored, FP8 layers and NVFP4 Linears the model runs unquantized become BF16, and the layers
the model would otherwise quantize are listed in ignored_layers. A refused layer fails the whole
convert, naming it. Streaming (one layer in memory at a time), built beside the target and renamed
into place at the end: a failure or an interruption leaves no output directory.

Exit status: 0 success, 2 usage or validation error, 1 I/O error, 128 + the signal's number for
SIGINT (130), SIGHUP (129), SIGQUIT (131) and SIGTERM (143)."""


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``convert``."""
    # from spec (stdlib only): building the parser must not import torch, or every command
    # (merge included) would pay its import time and memory
    from .spec import REQUANT_DEFAULT_RULE as DEFAULT_RULE
    from .spec import REQUANT_RULES

    parser.add_argument(
        "--input", required=True, help="NVFP4 pipeline directory, or one transformer directory."
    )
    parser.add_argument("--output", required=True, help="MXFP4 directory to create.")
    parser.add_argument(
        "--scale-rule",
        choices=REQUANT_RULES,
        default=DEFAULT_RULE,
        help="E8M0 exponent rule per 32-block: floor (OCP), even (SGLang, AITER), rceil, or mse (default: "
        "the least squared error among floor's exponent and its neighbours; never worse than the others).",
    )
    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="Shard each converted transformer into files of at most SIZE (e.g. 5GB) plus an index. "
        "Default: one file.",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="Threads that requantize each layer (each running single-threaded torch ops, which is faster "
        "than splitting every op). Default: torch's thread count (os.cpu_count() unless OMP_NUM_THREADS "
        "says otherwise).",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="Detect, plan and report; compute and write nothing."
    )
    parser.add_argument("--overwrite", action="store_true", help="Replace an existing output directory.")
    parser.add_argument("--json", action="store_true", help="Print a machine-readable JSON report instead.")


def _layer_line(layer) -> str:
    if layer.action == "mxfp4" and layer.rel_rms is not None:
        share = layer.exact_blocks / layer.total_blocks if layer.total_blocks else 1.0
        return (
            f"    {layer.name}: mxfp4 ({layer.rule}) rel_rms={layer.rel_rms:.4g} max_abs={layer.max_abs:.4g} "
            f"exact_blocks={share:.1%}"
        )
    return f"    {layer.name}: {layer.action} ({layer.rule or layer.reason})"


def format_convert_summary(report) -> str:
    """The human-readable summary of a :class:`~vllm_omni_mxfp4.convert.ConvertReport`: per
    component the counts, then one line per layer (its action and rule, and its requantization
    error against the exact NVFP4 dequant)."""
    head = "dry run, nothing written:" if report.dry_run else "converted"
    lines = [f"{head} {report.input_path} -> {report.output_path} (scale rule {report.scale_rule})"]
    for c in report.components:
        lines.append(
            f"  {c.name}: {c.model_class} NVFP4 by {c.producer}: {c.count('mxfp4')} MXFP4, {c.count('bf16')} BF16, "
            f"{c.count('kept')} kept as stored ({len(c.ignored_layers)} ignored_layers); "
            f"{_human(c.bytes_in)} in, {_human(c.bytes_out)} out, {c.seconds:.2f} s"
        )
        lines.extend(_layer_line(layer) for layer in c.layers)
        lines.extend(f"    warning: {w}" for w in c.warnings)
    lines.append(
        f"  copied {report.copied_files} other files ({_human(report.copied_bytes)}); total {report.seconds:.2f} s"
    )
    lines.extend(f"  removed {path}, left by a killed run" for path in report.removed_stale)
    lines.extend(
        f"  stale: {path}, left by a killed run; the next run removes it" for path in report.stale_staging
    )
    return "\n".join(lines)


def run_convert(args: argparse.Namespace) -> int:
    """Run ``convert`` for parsed arguments; prints the summary or the error; returns the exit status."""
    import torch

    from .convert import convert

    workers = args.threads or torch.get_num_threads()
    if workers < 1:
        print(f"error: --threads must be at least 1, got {workers}", file=sys.stderr)
        return 2
    if workers > 1:
        torch.set_num_threads(1)  # the workers run single-threaded ops (kernels/requant.py)

    def work():
        return convert(
            args.input,
            args.output,
            scale_rule=args.scale_rule,
            max_shard_size=args.max_shard_size,
            dry_run=args.dry_run,
            overwrite=args.overwrite,
            workers=workers,
        )

    return run_guarded(args, work, format_convert_summary)


INSPECT_DESCRIPTION = """\
Validate a checkpoint before deployment without starting the engine (no accelerator, bounded
memory). PATH is a diffusers pipeline (model_index.json) or one component directory (config.json).
For each transformer component: the quantization method auto-detection picks from its config.json,
then one row per runtime Linear of vLLM-Omni's model class (built on the meta device from the
component's config; each checkpoint tensor traced through the model's own loader): format,
precision (BF16, W4A4, W4A8, W8A8 for MXFP8 layers), Smooth, the checkpoint tensors with their dtypes and shapes,
and every inconsistency: missing tensors, wrong dtypes or shapes, scales out of range, a quantized
layer listed in ignored_layers, a BF16 Linear without a BF16 weight, layer names that match no
Linear. Reads safetensors headers and the small tensors only (scales, Smooth vectors, biases).
Merged msModelSlim checkpoints, NVFP4 exports and converted checkpoints; for a plain BF16 model
the rows show what online --quantization mxfp4 would quantize.

Exit status: 0 no problem found, 2 problems found, 1 I/O error (a missing or unreadable path)."""


def run_inspect(args: argparse.Namespace) -> int:
    """Run ``inspect``; prints the table (or JSON) and returns 0, 2 (problems) or 1 (I/O error)."""
    import contextlib

    from .inspection import format_table, inspect_path

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout; the report owns it
            report = inspect_path(args.path, args.component)
    except OSError as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc)}))
        else:
            print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_table(report))
    return 0 if report.ok else 2


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``inspect``."""
    parser.add_argument("path", metavar="PATH", help="Pipeline directory, or one transformer directory.")
    parser.add_argument(
        "--component", metavar="NAME", help="Inspect only this component (e.g. transformer_2)."
    )
    parser.add_argument("--json", action="store_true", help="Print a machine-readable JSON report instead.")


COMPARE_DESCRIPTION = """\
Run MODEL with the same prompts and seeds under BF16 (always first: the reference) and under each
--config, through vLLM-Omni's own pipeline on whatever platform is present (Omni(...) with this
package's kernels; one engine per config, run one after another). For every denoising step: the
cosine and MSE of the latents against BF16's at that step. On the final frames: PSNR, SSIM and cosine
against BF16's. Also the weight bytes the transformers hold and the time per generation. Writes
OUT/compare.json (every number, per request and averaged) and OUT/compare.png (the per-step cosine
curves above one frame strip per config) and prints a summary table.

--config takes a method name (mxfp4), an inline JSON quantization config
('{"method": "mxfp4", "w4a8_fallback_steps": [0, 19]}') or @file.json (a tune config.json), each
optionally as label=... . Per-step measures need a pipeline that steps through vLLM-Omni's
scheduler_step_maybe_with_cfg (Wan2.2, FLUX.1, FLUX.2, SD3, HunyuanVideo-1.5, ...).

Exit status: 0 done, 2 bad arguments or a config the engine refused."""


def _say(text: str) -> None:
    """Print a line of this CLI's own. vLLM decorates the standard streams of a process that hosts a
    worker with a ``(DiffusionWorker pid=...)`` prefix and keeps the undecorated ``write`` as
    ``_original_write``: this CLI's lines do not come from a worker, so they go out undecorated."""
    for stream in (sys.stdout, sys.stderr):
        original = getattr(stream, "_original_write", None)
        if original is not None:
            stream.write = original
    print(text, flush=True)


def add_generation_arguments(parser: Any) -> None:
    """The generation settings ``compare`` and ``tune`` run every request with (one definition)."""
    parser.add_argument("--steps", type=int, default=20, help="Denoising steps (default 20).")
    parser.add_argument("--height", type=int, default=None, help="Output height (default: the pipeline's).")
    parser.add_argument("--width", type=int, default=None, help="Output width (default: the pipeline's).")
    parser.add_argument(
        "--num-frames", type=int, default=None, help="Video frames (default: the pipeline's)."
    )
    parser.add_argument(
        "--guidance-scale", type=float, default=None, help="Guidance scale (default: the pipeline's)."
    )
    parser.add_argument(
        "--guidance-scale-2", type=float, default=None,
        help="Wan2.2's low-noise expert guidance (default: the pipeline's).",
    )  # fmt: skip
    parser.add_argument("--negative-prompt", default="", help="Negative prompt (default none).")
    parser.add_argument("--image", default=None, help="Input image file of an image-to-video pipeline.")


def generation_settings(args: argparse.Namespace) -> Any:
    """The :class:`~vllm_omni_mxfp4.compare.run.Settings` of :func:`add_generation_arguments`' flags."""
    from .compare.run import Settings

    return Settings(
        steps=args.steps,
        height=args.height,
        width=args.width,
        num_frames=args.num_frames,
        guidance_scale=args.guidance_scale,
        guidance_scale_2=args.guidance_scale_2,
        negative_prompt=args.negative_prompt,
        image=_image(args.image),
    )


def _image(path: str | None) -> str | None:
    """An ``--image`` file, checked before any engine starts."""
    if path is not None and not Path(path).is_file():
        print(f"vllm-omni-mxfp4: error: --image {path}: no such file", file=sys.stderr)
        raise SystemExit(2)
    return path


def run_compare(args: argparse.Namespace) -> int:
    """Run ``compare``; prints progress and the summary table."""
    from .compare.report import summary_table, write
    from .compare.run import Request, compare, parse_config

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        configs = [parse_config(text, i) for i, text in enumerate(args.config)]
    except ValueError as exc:
        print(f"vllm-omni-mxfp4 compare: error: {exc}", file=sys.stderr)
        return 2
    requests = [Request(p, s) for p in args.prompt for s in args.seed]
    settings = generation_settings(args)
    out = Path(args.out)
    _say(f"compare: {len(configs) + 1} configs x {len(requests)} request(s), {args.steps} steps -> {out}")
    try:
        runs = compare(args.model, configs, requests, settings, out / "trajectories", progress=_say)
    except ValueError as exc:
        _say(f"vllm-omni-mxfp4 compare: error: {exc}")
        return 2
    table = write(out, args.model, settings, requests, runs)
    _say(summary_table(table))
    _say(f"wrote {out / 'compare.json'} and {out / 'compare.png'}")
    return 0


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``compare``."""
    parser.add_argument("model", metavar="MODEL", help="A diffusers pipeline directory (or a model name).")
    parser.add_argument(
        "--config", action="append", default=[], metavar="[LABEL=]SPEC",
        help="A configuration to compare with BF16: a method name, inline JSON or @file.json (repeatable).",
    )  # fmt: skip
    parser.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="A prompt (repeatable; every prompt runs every seed).",
    )
    parser.add_argument(
        "--seed", action="append", type=int, default=None, help="A seed (repeatable; default 0)."
    )
    add_generation_arguments(parser)
    parser.add_argument("--out", default="compare-out", help="Output directory (default compare-out).")


def _compare_defaults(args: argparse.Namespace) -> argparse.Namespace:
    if args.seed is None:
        args.seed = [0]
    return args


TUNE_DESCRIPTION = """\
Find what to keep in higher precision. One engine quantizes MODEL online with --method (keeping the
BF16 weights on the host) and runs, on the tuning prompts x seeds:

1. a scoring pass: the BF16 trajectory, each quantized Linear's W4A4 (and W4A8) output against its
   BF16 output on the model's own activations at every step (local scores), and each step's
   transformer prediction at W4A4 and W4A8 against BF16 (step scores);
2. all Linears W4A4;
3. each candidate (the Linears with the largest local error) alone in W4A4, everything else BF16:
   its end-to-end gain is the trajectory error it causes alone, as a share of all-W4A4's;
4. the selected configuration.

That is (candidates + 3) generations per tuning request. The selection keeps in BF16 the Linears
with the largest gains within --max-bf16-layers / --max-bf16-fraction (by gain per byte under a byte
budget), runs W4A8 on the Linears and steps W4A8 helps most (single-scale mxfp4 only). With
--eval-prompt / --eval-seed, BF16, all-W4A4, the first-N-blocks rule, the edge prior (outside the
blocks, then first and last blocks, as ModelOpt's Wan filter) and 5 random picks at the same budget
run on those held-out requests next to the tuned config, measured as compare measures them.

Writes OUT/config.json (the config to serve: Omni(quantization_config=...) or vllm serve --omni
--diffusion-quantization-config "$(cat OUT/config.json)"), OUT/scores.csv, OUT/scores.json and
OUT/report.png, and prints a summary.

Exit status: 0 done, 2 bad arguments or a model/config the engine refused."""


def run_tune(args: argparse.Namespace) -> int:
    """Run ``tune``; prints progress and the summary."""
    from .compare.run import Request
    from .tune.report import summary_table, write
    from .tune.run import tune
    from .tune.select import Budget

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        budget = Budget(
            args.max_bf16_layers, args.max_bf16_fraction, args.max_w4a8_layers, args.max_w4a8_steps
        )
        prompts = _prompts(args.prompt, args.prompt_file, "--prompt / --prompt-file")
        eval_prompts = _prompts(
            args.eval_prompt, args.eval_prompt_file, "--eval-prompt / --eval-prompt-file", []
        )
    except ValueError as exc:
        print(f"vllm-omni-mxfp4 tune: error: {exc}", file=sys.stderr)
        return 2
    if args.max_bf16_layers is None and args.max_bf16_fraction is None:
        budget = Budget(1, None, args.max_w4a8_layers, args.max_w4a8_steps)
    tuning = [Request(p, s) for p in prompts for s in args.seed or [0]]
    evaluation = [Request(p, s) for p in (eval_prompts or prompts) for s in args.eval_seed or []]
    settings = generation_settings(args)
    out = Path(args.out)
    _say(
        f"tune: {args.method}, {len(tuning)} tuning and {len(evaluation)} evaluation request(s), "
        f"{args.steps} steps -> {out}"
    )
    try:
        result = tune(
            args.model, args.method, tuning, settings, budget, out / "work", evaluation, args.candidates, _say
        )
    except ValueError as exc:
        _say(f"vllm-omni-mxfp4 tune: error: {exc}")
        return 2
    write(out, result)
    _say(summary_table(result))
    _say(f"wrote {out / 'config.json'}, {out / 'scores.csv'}, {out / 'scores.json'} and {out / 'report.png'}")
    return 0


def _prompts(
    given: list[str] | None, files: list[str] | None, flag: str, default: list | None = None
) -> list[str]:
    """Prompts from repeated flags and files (one prompt per non-empty line)."""
    prompts = list(given or [])
    for name in files or []:
        try:
            prompts += [line.strip() for line in Path(name).read_text().splitlines() if line.strip()]
        except OSError as exc:
            raise ValueError(f"{flag}: cannot read {name}: {exc.strerror}") from None
    if not prompts and default is None:
        raise ValueError(f"{flag}: give at least one prompt")
    return prompts


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``tune``."""
    parser.add_argument(
        "model", metavar="MODEL", help="A BF16 diffusers pipeline directory (or a model name)."
    )
    parser.add_argument(
        "--method", choices=("mxfp4", "mxfp4_dualscale"), default="mxfp4", help="Method (default mxfp4)."
    )
    parser.add_argument("--out", default="tune-out", help="Output directory (default tune-out).")
    run = parser.add_argument_group("run options")
    run.add_argument("--prompt", action="append", help="A tuning prompt (repeatable).")
    run.add_argument(
        "--prompt-file", action="append", help="A file of tuning prompts, one per line (repeatable)."
    )
    run.add_argument("--seed", action="append", type=int, help="A tuning seed (repeatable; default 0).")
    run.add_argument(
        "--eval-prompt",
        action="append",
        help="A held-out evaluation prompt (repeatable; default: the tuning prompts).",
    )
    run.add_argument("--eval-prompt-file", action="append", help="A file of evaluation prompts (repeatable).")
    run.add_argument(
        "--eval-seed",
        action="append",
        type=int,
        help="A held-out evaluation seed (repeatable; none: no evaluation).",
    )
    add_generation_arguments(run)
    budget = parser.add_argument_group("budget options (default: --max-bf16-layers 1)")
    budget.add_argument(
        "--max-bf16-layers", type=int, default=None, metavar="N", help="At most N Linears in BF16."
    )
    budget.add_argument(
        "--max-bf16-fraction", type=float, default=None, metavar="F",
        help="At most this share (0..1) of the quantized Linears' BF16 weight bytes in BF16.",
    )  # fmt: skip
    budget.add_argument(
        "--max-w4a8-layers", type=int, default=0, metavar="M", help="At most M W4A8 Linears (mxfp4 only)."
    )
    budget.add_argument(
        "--max-w4a8-steps", type=int, default=0, metavar="S", help="At most S W4A8 steps (mxfp4 only)."
    )
    budget.add_argument(
        "--candidates", type=int, default=None, metavar="C",
        help="Linears scored end to end (default: twice what the budget holds, at least 8).",
    )  # fmt: skip


@dataclass(frozen=True)
class Subcommand:
    """One subcommand: its name, one-line help, description, arguments and what runs it."""

    name: str
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand(
        "merge",
        "Merge msModelSlim MXFP4 output into a diffusers Wan2.2 checkpoint.",
        MERGE_DESCRIPTION,
        add_merge_arguments,
        run_merge,
    ),
    Subcommand(
        "convert",
        "Convert an NVFP4 diffusers checkpoint into an offline MXFP4 one.",
        CONVERT_DESCRIPTION,
        add_convert_arguments,
        run_convert,
    ),
    Subcommand(
        "inspect",
        "Validate a checkpoint before deployment: method, and each runtime Linear's precision and tensors.",
        INSPECT_DESCRIPTION,
        add_inspect_arguments,
        run_inspect,
    ),
    Subcommand(
        "compare",
        "Run a model under BF16 and each given config: per-step latent cosine/MSE, final PSNR/SSIM.",
        COMPARE_DESCRIPTION,
        add_compare_arguments,
        lambda args: run_compare(_compare_defaults(args)),
    ),
    Subcommand(
        "tune",
        "Score each quantized Linear and step; choose what stays BF16/W4A8 under a budget; write the config.",
        TUNE_DESCRIPTION,
        add_tune_arguments,
        run_tune,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand adds its own sub-parser."""
    parser = argparse.ArgumentParser(prog="vllm-omni-mxfp4", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        parser_of = subparsers.add_parser(
            command.name,
            help=command.help,
            description=command.description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_arguments(parser_of)
        parser_of.set_defaults(func=command.run)
    return parser


def merge_main(argv: list[str] | None = None) -> int:
    """``merge`` as a standalone program (tools/merge_mxfp4_dualscale_checkpoint.py)."""
    parser = argparse.ArgumentParser(
        prog="merge_mxfp4_dualscale_checkpoint.py",
        description=MERGE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_merge_arguments(parser)
    return run_merge(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args)) if hasattr(args, "func") else 2


if __name__ == "__main__":
    sys.exit(main())
