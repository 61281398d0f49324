"""The quantized video demo: one prompt through BF16 and every MXFP4 mode, compared frame by frame.

    python -m vllm_omni_mxfp4.demo [--modes bf16,mxfp4,...] [--steps N] [--out outputs/demo]
    python -m vllm_omni_mxfp4.demo --model /path/to/Wan2.2-T2V-A14B-Diffusers [--quant-path EXPORT]

Without ``--model`` it builds the embedded tiny two-expert Wan2.2 text-to-video pipeline (random
weights, seconds on a CPU), then:

1. quantizes it offline with msModelSlim (its own Smooth, W4A4_MXFP4_DUALSCALE quantizer and
   MindIE saver, on CPU; some layers stay FLOAT, every quantized one gets a Smooth factor) and
   merges the export into a diffusers checkpoint with ``vllm_omni_mxfp4.checkpoint.merge`` (what
   ``vllm-omni-mxfp4 merge`` runs);
2. generates the same prompt and seed through ``vllm_omni.Omni`` once per mode, each in its own
   process (see :data:`MODES`);
3. prints a table — PSNR and cosine similarity of the frames against BF16, the transformers' weight
   bytes in memory, engine start and generation time — and writes one video per mode, a PNG strip of
   frames of every mode, and the numbers as JSON and Markdown.

With ``--model PATH`` the same modes run on that checkpoint on whatever platform vLLM-Omni finds
(an accelerator, else the CPU platform); the offline mode then needs ``--quant-path`` (an existing
msModelSlim export of that model) and is skipped without it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

PROG = "python -m vllm_omni_mxfp4.demo"
DEFAULT_OUT = "outputs/demo"
DEFAULT_PROMPT = "a cat walking on the grass"
DEFAULT_NEGATIVE_PROMPT = "blurry low quality"
FPS = 16.0
MIB = 1024 * 1024

#: Generation defaults: the tiny model (no --model) and a real Wan2.2 checkpoint (the user guide's).
TINY_DEFAULTS = {"height": 64, "width": 64, "num_frames": 17, "steps": 20}
MODEL_DEFAULTS = {"height": 480, "width": 832, "num_frames": 81, "steps": 40}


@dataclass(frozen=True)
class Mode:
    """A way to run the model: a name, what it means, and its ``Omni(...)`` arguments."""

    name: str
    description: str
    omni_kwargs: Callable[[int], dict[str, Any]]  # steps -> kwargs
    offline: bool = False


def _last_steps(steps: int) -> list[int]:
    return sorted({0, steps - 1})


MODES: tuple[Mode, ...] = (
    Mode("bf16", "BF16, no quantization (the reference)", lambda steps: {}),
    Mode("mxfp4", "mxfp4 online, OCP scale rule", lambda steps: {"quantization": "mxfp4"}),
    Mode(
        "mxfp4-uos",
        "mxfp4 online, UOS scale rule",
        lambda steps: {"quantization_config": {"method": "mxfp4", "mxfp4_scale_alg": 2}},
    ),
    Mode(
        "mxfp4-w4a8",
        "mxfp4 online, W4A8 on the first and last denoising steps",
        lambda steps: {"quantization_config": {"method": "mxfp4", "w4a8_fallback_steps": _last_steps(steps)}},
    ),
    Mode(
        "dualscale",
        "mxfp4_dualscale online, every block quantized (num_bf16_fallback_layers 0; the default 5 keeps "
        "the first five blocks in BF16)",
        lambda steps: {"quantization_config": {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0}},
    ),
    Mode(
        "offline",
        "merged msModelSlim checkpoint (mxfp4_dualscale offline), no quantization argument: auto-detected",
        lambda steps: {},
        offline=True,
    ),
)
MODE_NAMES = tuple(m.name for m in MODES)


def parse_modes(text: str) -> list[Mode]:
    """Modes named in a comma-separated list, in :data:`MODES` order, always with ``bf16`` first."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODE_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODE_NAMES)}"
        )
    if not names:
        raise argparse.ArgumentTypeError("--modes is empty")
    wanted = set(names) | {"bf16"}
    return [m for m in MODES if m.name in wanted]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Quantized text-to-video demo: builds the tiny two-expert Wan2.2 pipeline (or uses --model), "
            "quantizes it offline with msModelSlim and merges it, generates one prompt with BF16 and every "
            "MXFP4 mode through vllm_omni.Omni, and prints PSNR / cosine against BF16, transformer weight "
            "bytes and timings; writes one video per mode and a PNG strip of frames."
        ),
        epilog="Modes: " + "; ".join(f"{m.name}: {m.description}" for m in MODES),
    )
    parser.add_argument(
        "--model",
        default=None,
        help="A diffusers Wan2.2 text-to-video pipeline directory. Default: the embedded tiny two-expert "
        "pipeline, built on first use.",
    )
    parser.add_argument(
        "--quant-path",
        default=None,
        help="With --model: an msModelSlim export of that model, merged for the offline mode. Without "
        "--model the demo makes its own export (ignored).",
    )
    parser.add_argument(
        "--modes",
        type=parse_modes,
        default=",".join(MODE_NAMES),
        help=f"Comma-separated subset of {','.join(MODE_NAMES)} (default: all). bf16 always runs: it is "
        "the reference.",
    )
    parser.add_argument(
        "--steps", type=_positive_int, default=None, help="Denoising steps (tiny: 20, --model: 40)."
    )
    parser.add_argument(
        "--height", type=_positive_int, default=None, help="Frame height (tiny: 64, --model: 480)."
    )
    parser.add_argument(
        "--width", type=_positive_int, default=None, help="Frame width (tiny: 64, --model: 832)."
    )
    parser.add_argument(
        "--num-frames",
        type=_positive_int,
        default=None,
        help="Frames, 4k+1 for Wan2.2 (tiny: 17, --model: 81).",
    )
    parser.add_argument("--seed", type=int, default=42, help="Generation seed (default 42).")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"Prompt (default {DEFAULT_PROMPT!r}).")
    parser.add_argument(
        "--negative-prompt",
        default=DEFAULT_NEGATIVE_PROMPT,
        help=f"Negative prompt (default {DEFAULT_NEGATIVE_PROMPT!r}).",
    )
    parser.add_argument(
        "--guidance-scale", type=float, default=5.0, help="Classifier-free guidance scale (default 5.0)."
    )
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help=f"Output directory (default {DEFAULT_OUT}); the demo's files in it are replaced.",
    )
    parser.add_argument(
        "--tensor-parallel-size", type=_positive_int, default=1, help="Tensor-parallel ranks (default 1)."
    )
    parser.add_argument(
        "--ulysses-degree",
        type=_positive_int,
        default=1,
        help="Ulysses sequence-parallel degree (default 1).",
    )
    parser.add_argument(
        "--cfg-parallel-size",
        type=int,
        choices=[1, 2],
        default=1,
        help="Ranks running the classifier-free-guidance branches in parallel (default 1).",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="Disable torch.compile and run eagerly.")
    parser.add_argument(
        "--timeout",
        type=_positive_int,
        default=1800,
        help="Seconds one mode (engine start + generation) may take before it is stopped (default 1800).",
    )
    return parser


# ------------------------------------------------------------------------------------------------
# Running one mode in a bounded process group
# ------------------------------------------------------------------------------------------------


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a live (non-zombie) member."""
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after its ')'.
            fields = stat[stat.rfind(")") + 2 :].split()
            if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _end_group(pgid: int, settle: float = 5.0) -> None:
    """Wait ``settle`` seconds for the process group to empty, then SIGTERM, then SIGKILL it."""
    for sig, wait in ((None, settle), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if not _group_alive(pgid):
            return
        if sig is not None:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.2)


def run_engine_job(job: dict[str, Any], run_dir: Path, timeout: float) -> tuple[dict[str, Any] | None, str]:
    """Run :mod:`.engine_job` in a new session; returns (result or None, error text)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    job_path = run_dir / "job.json"
    job_path.write_text(json.dumps(job, indent=2))
    log_path = run_dir / "engine.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_omni_mxfp4.demo.engine_job", str(job_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        except BaseException:
            _end_group(proc.pid, settle=0.0)
            raise
        finally:
            _end_group(proc.pid, settle=0.0 if proc.poll() is None else 5.0)
            proc.wait()
    if rc is None:
        return None, f"did not finish within {timeout:.0f} s (log: {log_path})"
    if rc != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        return None, f"exited with {rc} (log: {log_path}): " + " | ".join(tail)
    return json.loads((run_dir / "result.json").read_text()), ""


# ------------------------------------------------------------------------------------------------
# The offline step: msModelSlim export + merge
# ------------------------------------------------------------------------------------------------


def offline_checkpoint(model: Path, quant_path: Path | None, out: Path, say: Callable[[str], None]) -> Path:
    """The merged offline checkpoint under ``out``: exports with msModelSlim first when ``quant_path`` is None."""
    from ..checkpoint import merge

    if quant_path is None:
        from .msmodelslim_export import export_pipeline

        quant_path = out / "msmodelslim-export"
        if quant_path.exists():
            shutil.rmtree(quant_path)
        start = time.perf_counter()
        say("msModelSlim: quantizing the experts (W4A4_MXFP4_DUALSCALE with Smooth; some layers stay FLOAT)")
        references = export_pipeline(model, quant_path)
        counts = ", ".join(f"{name}: {len(refs)} Linears" for name, refs in references.items())
        say(f"msModelSlim: export written to {quant_path} ({counts}) in {time.perf_counter() - start:.1f} s")
    merged = out / "merged-mxfp4-dualscale"
    start = time.perf_counter()
    report = merge("auto", model, quant_path, merged, overwrite=True, non_block_quantized="original")
    for t in report.transformers:
        say(
            f"merge: {t.name}: {t.quant_method}, {t.layers_quantized} layers quantized "
            f"({t.smooth_layers} with Smooth), {t.layers_bf16} kept BF16"
        )
        for warning in t.warnings:
            say(f"merge: {t.name}: warning: {warning}")
    say(f"merge: checkpoint written to {merged} in {time.perf_counter() - start:.1f} s")
    return merged


# ------------------------------------------------------------------------------------------------
# Reporting
# ------------------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return format(value, spec)


def table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """The summary table (header first) from the per-mode result dicts."""
    reference = next((r for r in results if r["mode"] == "bf16" and r.get("weight_bytes")), None)
    rows = [["mode", "PSNR dB", "cosine", "weights MiB", "vs BF16", "+backend MiB", "start s", "gen s"]]
    for r in results:
        if r.get("error"):
            rows.append([r["mode"], "failed", "", "", "", "", "", ""])
            continue
        ratio = r["weight_bytes"] / reference["weight_bytes"] if reference else None
        rows.append(
            [
                r["mode"],
                _fmt(r["psnr"], ".2f"),
                _fmt(r["cosine"], ".5f"),
                _fmt(r["weight_bytes"] / MIB, ".2f"),
                _fmt(ratio, ".3f") + ("x" if ratio is not None else ""),
                _fmt(r["backend_bytes"] / MIB, ".2f"),
                _fmt(r["load_s"], ".1f"),
                _fmt(r["gen_s"], ".2f"),
            ]
        )
    return rows


def format_table(rows: list[list[str]]) -> str:
    """Fixed-width text table."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[list[str]]) -> str:
    """The same table in Markdown."""
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM -> SystemExit, so that a running engine process group is ended on the way out."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """The demo's entry point; returns the exit status (0 ok, 1 a mode failed, 2 bad arguments)."""
    args = build_parser().parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return _run(args)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()

    def say(message: str) -> None:
        tqdm.write(f"[demo {time.perf_counter() - started:6.1f}s] {message}")

    defaults = TINY_DEFAULTS if args.model is None else MODEL_DEFAULTS
    steps = args.steps or defaults["steps"]
    height, width = args.height or defaults["height"], args.width or defaults["width"]
    num_frames = args.num_frames or defaults["num_frames"]
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    modes: list[Mode] = args.modes

    if args.model is None:
        from .tiny_wan import build_tiny_wan

        if args.quant_path is not None:
            say("--quant-path ignored: without --model the demo quantizes the tiny model itself")

        say("building (or reusing) the embedded tiny two-expert Wan2.2 text-to-video pipeline")
        model = build_tiny_wan(2)
        say(f"model: {model}")
    else:
        model = Path(args.model).expanduser().absolute()
        if not (model / "model_index.json").is_file():
            print(
                f"{PROG}: error: --model {model}: not a diffusers pipeline directory (no model_index.json)",
                file=sys.stderr,
            )
            return 2
        if args.quant_path is not None and not Path(args.quant_path).expanduser().is_dir():
            print(f"{PROG}: error: --quant-path {args.quant_path}: no such directory", file=sys.stderr)
            return 2
    index = json.loads((model / "model_index.json").read_text())
    boundary_ratio = index.get("boundary_ratio")

    offline_model = None
    failed_early: dict[str, str] = {}
    if any(m.offline for m in modes):
        if args.model is not None and args.quant_path is None:
            say(
                "offline mode skipped: --model without --quant-path (give an msModelSlim export of the model)"
            )
            modes = [m for m in modes if not m.offline]
        else:
            quant_path = None if args.model is None else Path(args.quant_path).expanduser().absolute()
            try:
                offline_model = offline_checkpoint(model, quant_path, out, say)
            except Exception as exc:  # the other modes still run; the summary reports this one
                failed_early["offline"] = f"offline step failed: {type(exc).__name__}: {exc}"
                say(f"offline: FAILED: {failed_early['offline']}")

    say(
        f"generating {num_frames} frames of {width}x{height}, {steps} steps, seed {args.seed}, prompt "
        f"{args.prompt!r}, in {len(modes)} modes (one engine process each; logs under {out / 'runs'})"
    )
    parallel = {
        "tensor_parallel_size": args.tensor_parallel_size,
        "ulysses_degree": args.ulysses_degree,
        "cfg_parallel_size": args.cfg_parallel_size,
        "enforce_eager": args.enforce_eager,
    }
    results: list[dict[str, Any]] = []
    frames_by_mode: dict[str, np.ndarray] = {}
    scale_frames = None
    bar = tqdm(
        modes, desc="modes", unit="mode", file=sys.stderr, leave=False, disable=not sys.stderr.isatty()
    )
    for number, mode in enumerate(bar, start=1):
        tag = f"({number}/{len(modes)}) {mode.name}"
        run_dir = out / "runs" / mode.name
        if run_dir.exists():
            shutil.rmtree(run_dir)
        kwargs = mode.omni_kwargs(steps)
        entry: dict[str, Any] = {"mode": mode.name, "description": mode.description, "omni_kwargs": kwargs}
        if mode.name in failed_early:
            entry["error"] = failed_early[mode.name]
            results.append(entry)
            continue
        job = {
            "model": str(offline_model if mode.offline else model),
            "out": str(run_dir),
            "omni_kwargs": {**parallel, **kwargs},
            "prompt": args.prompt,
            "negative_prompt": args.negative_prompt,
            "height": height,
            "width": width,
            "num_frames": num_frames,
            "steps": steps,
            "guidance_scale": args.guidance_scale,
            "seed": args.seed,
            "boundary_ratio": boundary_ratio,
            # The reference engine also renders another seed: how far apart two different videos are.
            "scale_seed": args.seed + 1 if mode.name == "bf16" else None,
        }
        say(
            f"{tag}: Omni(model=..., "
            + (", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "no quantization argument")
            + ")"
        )
        result, error = run_engine_job(job, run_dir, args.timeout)
        if result is None:
            say(f"{tag}: FAILED: {error}")
            entry["error"] = error
            results.append(entry)
            continue
        frames_by_mode[mode.name] = np.load(run_dir / "frames.npy")
        if (run_dir / "frames_scale_seed.npy").is_file():
            scale_frames = np.load(run_dir / "frames_scale_seed.npy")
        entry.update(
            load_s=result["load_s"],
            gen_s=result["gen_s"],
            platform=result["platform"],
            weight_bytes=sum(t["weight_bytes"] for t in result["transformers"]),
            backend_bytes=sum(t["backend_bytes"] for t in result["transformers"]),
            kernel_bytes=sum(t["kernel_bytes"] for t in result["transformers"]),
            transformers=result["transformers"],
        )
        say(f"{tag}: engine started in {result['load_s']:.1f} s, generated in {result['gen_s']:.2f} s")
        results.append(entry)

    return _finish(args, out, results, frames_by_mode, scale_frames, model, offline_model, started, say)


def _finish(
    args: argparse.Namespace,
    out: Path,
    results: list[dict[str, Any]],
    frames_by_mode: dict[str, np.ndarray],
    scale_frames: np.ndarray | None,
    model: Path,
    offline_model: Path | None,
    started: float,
    say: Callable[[str], None],
) -> int:
    from .engine_report import TransformerReport
    from .media import frame_strip, upscale, write_video
    from .metrics import cosine, psnr

    reference = frames_by_mode.get("bf16")
    videos = {}
    for entry in results:
        frames = frames_by_mode.get(entry["mode"])
        if frames is None:
            continue
        entry["psnr"] = psnr(frames, reference) if reference is not None else None
        entry["cosine"] = cosine(frames, reference) if reference is not None else None
        factor = max(1, -(-256 // min(frames.shape[1:3])))
        videos[entry["mode"]] = write_video(upscale(frames, factor), out / f"{entry['mode']}.mp4", fps=FPS)
        entry["video"] = str(videos[entry["mode"]])
    strip = None
    if frames_by_mode:
        strip = frame_strip(
            [(name, frames) for name, frames in frames_by_mode.items()], out / "frames_strip.png"
        )

    rows = table_rows(results)
    scale = None
    if reference is not None and scale_frames is not None:
        scale = {
            "seed": args.seed + 1,
            "psnr": psnr(scale_frames, reference),
            "cosine": cosine(scale_frames, reference),
        }
    platform = next((r["platform"] for r in results if r.get("platform")), "unknown (no engine started)")
    (out / "results.json").write_text(
        json.dumps(
            {
                "model": str(model),
                "offline_checkpoint": str(offline_model) if offline_model else None,
                "platform": platform,
                "settings": {
                    k: getattr(args, k) for k in ("prompt", "negative_prompt", "seed", "guidance_scale")
                },
                "modes": results,
                "bf16_other_seed": scale,
            },
            indent=2,
            default=str,
        )
    )
    legend = [
        "PSNR and cosine: the frames of each mode against the BF16 frames (same prompt, seed and steps); "
        "cosine over pixels mapped to [-1, 1]."
        + (
            f" For scale, BF16 with seed {scale['seed']} instead of {args.seed} (another video): "
            f"PSNR {_fmt(scale['psnr'], '.2f')} dB, cosine {_fmt(scale['cosine'], '.5f')}."
            if scale
            else ""
        ),
        "weights MiB: every tensor the transformers hold (packed FP4 weights, scales, Smooth vectors, BF16 "
        "layers, norms, biases), read from the live modules in the engine process (all experts, all ranks); "
        "BF16 Linear weights that vLLM's CPU GEMM moved into oneDNN count as N x K x 2 bytes.",
        "+backend MiB: working buffers of the MXFP4 backend on top (the emulated backend caches dequantized "
        "weights for speed; VLLM_OMNI_MXFP4_EMULATED_CACHE=0 turns that off).",
        "start s: Omni(...) construction (load, quantize, warm-up); gen s: omni.generate for one video.",
    ]
    (out / "results.md").write_text(
        f"Platform: {platform}\n\n{markdown_table(rows)}\n\n"
        + "\n".join(f"- {m['mode']}: {m['description']}" for m in results)
        + "\n\n"
        + "\n".join(f"- {line}" for line in legend)
        + "\n"
    )

    print()
    print(f"Platform: {platform}")
    print(f"Model: {model}" + (f"\nOffline checkpoint: {offline_model}" if offline_model else ""))
    print()
    print(format_table(rows))
    print()
    for entry in results:
        print(f"{entry['mode']}: {entry['description']}")
        for t in entry.get("transformers", []):
            report = TransformerReport(**t)
            print(f"    {report.name}: {report.summary()}")
        if entry.get("error"):
            print(f"    FAILED: {entry['error']}")
    print()
    for line in legend:
        print(line)
    print()
    print(f"Output directory: {out}")
    if strip is not None:
        print(f"  frames strip: {strip}")
    for name, path in videos.items():
        print(f"  video {name}: {path}")
    print(f"  numbers: {out / 'results.json'}, {out / 'results.md'}")
    failed = [r["mode"] for r in results if r.get("error")]
    say(
        f"done in {time.perf_counter() - started:.1f} s"
        + (f"; FAILED modes: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0
