"""The demo's report: the summary table, ``results.json``, ``results.md``, videos, a frame strip, the console.

The per-mode result entries (dicts, as ``results.json`` stores them) come from
:mod:`vllm_omni_mxfp4_demo.main`; :func:`score` adds PSNR and cosine against the BF16 frames,
:func:`write_media` the videos and the strip, and :func:`publish` writes the numbers and prints the
summary.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vllm_omni_mxfp4.compare.metrics import cosine, psnr
from vllm_omni_mxfp4.inspection.engine import LoadedTransformer

from .media import frame_strip, to_uint8, upscale, write_video

MIB = 1024 * 1024
FPS = 16.0


@dataclass
class Summary:
    """Everything the report shows: the run's inputs, the per-mode entries and the files written."""

    out: Path
    model: Path
    offline_model: Path | None
    settings: dict[str, Any]
    results: list[dict[str, Any]]
    other_seed: dict[str, Any] | None = None
    videos: dict[str, Path] = field(default_factory=dict)  # mode -> its video (or image) file
    strip: Path | None = None
    nvfp4_quality: list[dict[str, Any]] | None = None

    @property
    def platform(self) -> str:
        return next((r["platform"] for r in self.results if r.get("platform")), "unknown (no engine started)")

    @property
    def failed(self) -> list[str]:
        return [r["mode"] for r in self.results if r.get("error")]


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return format(value, spec)


def _accuracy_cells(entry: dict[str, Any]) -> list[str]:
    scored = entry.get("accuracy")
    if scored is None:
        return ["n/a", "n/a"]
    return [
        f"{_fmt(100 * scored[key]['accuracy'], '.0f')}% of {scored[key]['outputs']}"
        for key in ("seen", "held_out")
    ]


def table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """The summary table (header first) from the per-mode result dicts; prompt-accuracy columns when a
    mode was scored (the trained tiny model's task prompts)."""
    reference = next((r for r in results if r["mode"] == "bf16" and r.get("weight_bytes")), None)
    scored = any(r.get("accuracy") for r in results)
    header = ["mode", "PSNR dB", "cosine"]
    header += ["set PSNR dB", "accuracy seen", "accuracy held-out"] if scored else []
    rows = [header + ["weights MiB", "vs BF16", "+backend MiB", "start s", "gen s"]]
    for r in results:
        if r.get("error"):
            rows.append([r["mode"], "failed"] + [""] * (len(rows[0]) - 2))
            continue
        ratio = r["weight_bytes"] / reference["weight_bytes"] if reference else None
        rows.append(
            [r["mode"], _fmt(r["psnr"], ".2f"), _fmt(r["cosine"], ".5f")]
            + ([_fmt(r.get("set_psnr"), ".2f"), *_accuracy_cells(r)] if scored else [])
            + [
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


def score(
    results: list[dict[str, Any]],
    frames_by_mode: dict[str, np.ndarray],
    evaluation_by_mode: dict[str, np.ndarray] | None = None,
) -> None:
    """Add ``psnr`` and ``cosine`` against the BF16 frames to each entry that has frames, and
    ``set_psnr``, the mean PSNR of its prompt-accuracy outputs against BF16's for the same prompt and
    seed, where both were generated (one video says little: a mode can land near or far by chance)."""
    reference = frames_by_mode.get("bf16")
    evaluation_by_mode = evaluation_by_mode or {}
    set_reference = evaluation_by_mode.get("bf16")
    for entry in results:
        frames = frames_by_mode.get(entry["mode"])
        if frames is not None:
            entry["psnr"] = psnr(frames, reference) if reference is not None else None
            entry["cosine"] = cosine(frames, reference) if reference is not None else None
        outputs = evaluation_by_mode.get(entry["mode"])
        if outputs is not None and set_reference is not None and len(outputs) == len(set_reference):
            entry["set_psnr"] = float(np.mean([psnr(o, r) for o, r in zip(outputs, set_reference)]))


def other_seed(reference: np.ndarray | None, frames: np.ndarray | None, seed: int) -> dict[str, Any] | None:
    """BF16 with another seed against the reference: how far apart two different videos are."""
    if reference is None or frames is None:
        return None
    return {"seed": seed, "psnr": psnr(frames, reference), "cosine": cosine(frames, reference)}


def write_media(summary: Summary, frames_by_mode: dict[str, np.ndarray]) -> None:
    """One video per mode (a PNG where the output is one image; enlarged to at least 256 pixels) and a
    strip of frames of every mode, its rows in the table's order (engines finish in any order)."""
    from PIL import Image

    for entry in summary.results:
        frames = frames_by_mode.get(entry["mode"])
        if frames is None:
            continue
        factor = max(1, -(-256 // min(frames.shape[1:3])))
        if frames.shape[0] == 1:
            path = summary.out / f"{entry['mode']}.png"
            Image.fromarray(to_uint8(upscale(frames[0], factor))).save(path)
            entry["image"] = str(path)
        else:
            path = write_video(upscale(frames, factor), summary.out / f"{entry['mode']}.mp4", fps=FPS)
            entry["video"] = str(path)
        summary.videos[entry["mode"]] = path
    if frames_by_mode:
        order = [entry["mode"] for entry in summary.results if entry["mode"] in frames_by_mode]
        order += [mode for mode in frames_by_mode if mode not in order]
        rows = [(mode, frames_by_mode[mode]) for mode in order]
        summary.strip = frame_strip(rows, summary.out / "frames_strip.png")


def legend(summary: Summary) -> list[str]:
    """What the table's columns mean."""
    scale = summary.other_seed
    return [
        "PSNR and cosine: the frames of each mode against the BF16 frames (same prompt, seed and steps); "
        "cosine over pixels mapped to [-1, 1]."
        + (
            f" For scale, BF16 with seed {scale['seed']} instead of {summary.settings['seed']} (another "
            f"video): PSNR {_fmt(scale['psnr'], '.2f')} dB, cosine {_fmt(scale['cosine'], '.5f')}."
            if scale
            else ""
        ),
        "weights MiB: every tensor the transformers hold (packed FP4 weights, scales, Smooth vectors, BF16 "
        "layers, norms, biases), read from the live modules in the engine process (all experts, all ranks); "
        "BF16 Linear weights that vLLM's CPU GEMM moved into oneDNN count as N x K x 2 bytes.",
        "+backend MiB: working buffers of the MXFP4 backend on top (the emulated backend caches dequantized "
        "weights for speed; VLLM_OMNI_MXFP4_EMULATED_CACHE=0 turns that off).",
        "start s: Omni(...) construction (load, quantize, warm-up); gen s: omni.generate for one output.",
    ] + _accuracy_legend(summary.results)


def _accuracy_legend(results: list[dict[str, Any]]) -> list[str]:
    scored = next((r["accuracy"] for r in results if r.get("accuracy")), None)
    if scored is None:
        return []
    attributes = ", ".join(scored["seen"]["per_attribute"]) or "every attribute the prompt names"
    return [
        "set PSNR: the mean PSNR of the mode's prompt-accuracy outputs against BF16's outputs for the same "
        "prompts and seeds (every output of the set, not the one video of the first two columns).",
        "accuracy seen / held-out: share of the fixed prompt-accuracy set's outputs (task prompts the model "
        "was trained on / prompts with colour x shape pairs it never saw, each with seeds training never "
        "used) in which the detector with no learned weights reads every attribute as prompted: "
        f"{attributes} (vllm_omni_mxfp4_tiny.detect).",
    ]


def _write_files(summary: Summary, rows: list[list[str]], notes: list[str]) -> None:
    numbers = {
        "model": str(summary.model),
        "offline_checkpoint": str(summary.offline_model) if summary.offline_model else None,
        "platform": summary.platform,
        "settings": summary.settings,
        "modes": summary.results,
        "bf16_other_seed": summary.other_seed,
        "nvfp4_quality": summary.nvfp4_quality,
    }
    (summary.out / "results.json").write_text(json.dumps(numbers, indent=2, default=str))
    (summary.out / "results.md").write_text(
        f"Platform: {summary.platform}\n\n{markdown_table(rows)}\n\n"
        + "\n".join(f"- {m['mode']}: {m['description']}" for m in summary.results)
        + "\n\n"
        + "\n".join(f"- {line}" for line in notes)
        + "\n"
    )


def _print_console(summary: Summary, rows: list[list[str]], notes: list[str]) -> None:
    offline = f"\nOffline checkpoint: {summary.offline_model}" if summary.offline_model else ""
    print(f"\nPlatform: {summary.platform}\nModel: {summary.model}{offline}\n")
    print(format_table(rows) + "\n")
    for entry in summary.results:
        print(f"{entry['mode']}: {entry['description']}")
        for t in entry.get("transformers", []):
            print(f"    {t['name']}: {LoadedTransformer(**t).summary()}")
        if entry.get("error"):
            print(f"    FAILED: {entry['error']}")
    print()
    for line in notes:
        print(line)
    if summary.nvfp4_quality:
        from .nvfp4_quality import format_table as nvfp4_table

        print(
            "\nNVFP4 sources (tiny transformer's output vs unquantized, block Linears emulated in float32):"
        )
        print(nvfp4_table(summary.nvfp4_quality))
    print(f"\nOutput directory: {summary.out}")
    if summary.strip is not None:
        print(f"  frames strip: {summary.strip}")
    for name, path in summary.videos.items():
        print(f"  {'image' if path.suffix == '.png' else 'video'} {name}: {path}")
    print(f"  numbers: {summary.out / 'results.json'}, {summary.out / 'results.md'}")


def publish(summary: Summary) -> None:
    """Write ``results.json`` and ``results.md`` and print the table, each mode's methods and the files."""
    rows, notes = table_rows(summary.results), legend(summary)
    _write_files(summary, rows, notes)
    _print_console(summary, rows, notes)
