"""What tune writes: ``config.json``, ``scores.csv``, ``scores.json``, ``report.png``, the summary table.

``config.json`` is the quantization config of the tuned selection, as ``Omni(quantization_config=...)``
and ``vllm serve --omni --diffusion-quantization-config`` take it. ``scores.csv`` has one row per
quantized Linear (local scores, the end-to-end gain of the candidates, the gain selection used,
what was chosen), ``scores.json`` every number (per step too, the steps' scores, the cost, the
stability, the evaluation). ``report.png`` draws the sensitivity per block, per Linear and per step
above the latent cosine of BF16, all-W4A4 and the tuned selection along the steps.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..compare.report import COLOURS, jsonable
from .run import TuneResult, random_mean

MIB = 2**20


def _choice(result: TuneResult, key: str) -> str:
    if key in result.selection.bf16:
        return "bf16"
    if key in result.selection.w4a8:
        return "w4a8"
    return "w4a4"


def unit_rows(result: TuneResult) -> list[dict[str, Any]]:
    """One row per quantized Linear, in model order."""
    rows = []
    for unit in result.units:
        local = result.local.get(unit.key)
        outcome = result.e2e.get(unit.key)
        rows.append(
            {
                "component": unit.component,
                "layer": unit.layer,
                "block": unit.block,
                "n": unit.n,
                "k": unit.k,
                "bf16_extra_bytes": unit.extra_bytes,
                "local_rel_error_w4a4": None if local is None else local.a4.rel,
                "local_error_energy_w4a4": None if local is None else local.a4.err,
                "local_sqnr_db_w4a4": None if local is None else local.a4.sqnr,
                "local_cosine_w4a4": None if local is None else local.a4.cosine,
                "local_sqnr_db_w4a8": None if local is None or not local.a8.ref else local.a8.sqnr,
                "local_w4a8_gain": None if local is None else local.a8_gain,
                "candidate": unit.key in result.e2e,
                "e2e_gain": None if outcome is None else result.gains[unit.key],
                "alone_final_psnr_db": None if outcome is None else outcome.psnr,
                "alone_mean_latent_cosine": None if outcome is None else outcome.latent_cosine,
                "gain_used": result.gains.get(unit.key),
                "chosen": _choice(result, unit.key),
            }
        )
    return rows


def step_rows(result: TuneResult) -> list[dict[str, Any]]:
    return [
        {
            "step": s.step,
            "components": sorted(s.components),
            "rel_error_w4a4": s.a4.rel,
            "rel_error_w4a8": s.a8.rel if s.a8.ref else None,
            "w4a8_gain": s.gain,
            "chosen": s.step in result.selection.a8_steps,
        }
        for s in result.steps
    ]


def config_of(result: TuneResult) -> dict[str, Any]:
    """The tuned selection's quantization config."""
    return result.selection.config(result.method, result.components)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def document(result: TuneResult) -> dict[str, Any]:
    """``scores.json``."""
    c = result.cost
    return {
        "model": result.model,
        "method": result.method,
        "budget": vars(result.budget),
        "settings": vars(result.settings),
        "tuning_requests": [vars(r) for r in result.tuning],
        "evaluation_requests": [vars(r) for r in result.evaluation],
        "kept_by_default": {k: list(v) for k, v in result.kept.items()},
        "linears": unit_rows(result),
        "local_per_step": {
            key: {str(step): m.rel for step, m in sorted(score.a4_steps.items())}
            for key, score in result.local.items()
        },
        "steps": step_rows(result),
        "all_w4a4": vars(result.baseline),
        "candidates": result.candidates,
        "tuned": vars(result.tuned),
        "selection": {
            "bf16": list(result.selection.bf16),
            "w4a8": list(result.selection.w4a8),
            "w4a8_steps": list(result.selection.a8_steps),
        },
        "config": config_of(result),
        "stability_spearman": result.stability,
        "cost": vars(c),
        "evaluation": [{k: v for k, v in e.items() if k != "per_request"} for e in result.evaluated],
    }


def summary_rows(result: TuneResult) -> list[dict[str, Any]]:
    """The evaluation's rows for the table: BF16, all-W4A4, the priors (random ones as their mean, each
    also listed), tuned."""
    rows = [e for e in result.evaluated if not e["label"].startswith("random-")]
    mean = random_mean(result.evaluated)
    if mean is not None:
        rows.insert(len(rows) - 1, mean)
    return rows


def summary_table(result: TuneResult) -> str:
    """A readable table of the evaluation (or of the tuning requests' outcome without one)."""
    c = result.cost
    lines = [
        f"budget: {result.budget.describe()}; selected {len(result.selection.bf16)} BF16 Linears, "
        f"{len(result.selection.w4a8)} W4A8 Linears, W4A8 steps {list(result.selection.a8_steps)}",
        f"cost: {c.tuning_passes} passes (candidates + 3) x {len(result.tuning)} tuning request(s) = "
        f"{c.tuning_generations} generations in {c.tuning_seconds:.0f} s; engine start {c.engine_seconds:.0f} s"
        + (
            f"; evaluation {c.evaluation_generations} generations in {c.evaluation_seconds:.0f} s"
            if result.evaluated
            else ""
        ),
    ]
    st = result.stability
    if st.get("local") is not None or st.get("end_to_end") is not None:
        lines.append(
            "rank stability between the two halves of the tuning requests (Spearman): "
            + ", ".join(f"{k.replace('_', '-')} {v:.3f}" for k, v in st.items() if v is not None)
        )
    lines.append(
        f"tuning requests: all-W4A4 PSNR {result.baseline.psnr:.2f} dB -> tuned {result.tuned.psnr:.2f} dB"
    )
    if not result.evaluated:
        return "\n".join(lines)
    lines.append(f"held-out evaluation ({len(result.evaluation)} request(s)), against BF16:")
    lines.append(f"{'config':<22} {'BF16 MiB':>9} {'PSNR dB':>8} {'SSIM':>7} {'cosine':>8} {'accuracy':>9}")
    for row in summary_rows(result):
        final, acc = (
            {k: math.nan if v is None else v for k, v in row["final"].items()},
            row["prompt_accuracy"],
        )
        lines.append(
            f"{row['label']:<22} {row['bf16_extra_bytes'] / MIB:>9.3f} {final['psnr']:>8.2f} "
            f"{final['ssim']:>7.4f} {final['cosine']:>8.5f} {'-' if acc is None else f'{acc:.0%}':>9}"
        )
    return "\n".join(lines)


def _bars(
    draw: Any, box: tuple[int, int, int, int], title: str, values: list[float], marks: list[bool]
) -> None:
    """A bar chart of ``values`` in ``box``; marked bars in red."""
    left, top, right, bottom = box
    draw.rectangle(box, outline="black")
    draw.text((left, top - 14), title, fill="black")
    high = max([v for v in values if math.isfinite(v)] or [1.0]) or 1.0
    width = (right - left) / max(len(values), 1)
    for i, (value, mark) in enumerate(zip(values, marks)):
        if not math.isfinite(value) or value <= 0:
            continue
        x0 = left + i * width
        y = bottom - (bottom - top) * min(value / high, 1.0)
        draw.rectangle((x0 + 1, y, x0 + max(width - 1, 2), bottom), fill=COLOURS[1] if mark else COLOURS[2])


def write_png(path: Path, result: TuneResult, trajectories: dict[str, list[float]]) -> None:
    """Sensitivity per block, per Linear and per step, then latent cosine per step."""
    from PIL import Image, ImageDraw

    width, panel, pad = 900, 150, 36
    image = Image.new("RGB", (width, 4 * (panel + pad) + pad), "white")
    draw = ImageDraw.Draw(image)
    by_block: dict[tuple[str, int], float] = defaultdict(float)
    for unit in result.units:
        if unit.block is not None and unit.key in result.local:
            by_block[(unit.component, unit.block)] += result.local[unit.key].a4.rel
    blocks = sorted(by_block)
    y = pad
    _bars(
        draw, (60, y, width - 20, y + panel),
        "local W4A4 relative error per block (sum over its Linears), " + ", ".join(sorted({b[0] for b in blocks})),
        [by_block[b] for b in blocks], [False] * len(blocks),
    )  # fmt: skip
    y += panel + pad
    gains = [result.gains.get(u.key, 0.0) for u in result.units]
    _bars(
        draw, (60, y, width - 20, y + panel),
        "gain per Linear in model order (end to end for candidates, predicted otherwise); red: kept BF16",
        gains, [u.key in result.selection.bf16 for u in result.units],
    )  # fmt: skip
    y += panel + pad
    _bars(
        draw, (60, y, width - 20, y + panel),
        "per step: relative error of the W4A4 prediction removed by W4A8; red: W4A8 steps",
        [s.gain if s.a8.ref else s.a4.rel for s in result.steps], [s.step in result.selection.a8_steps for s in result.steps],
    )  # fmt: skip
    y += panel + pad
    left, top, right, bottom = 60, y, width - 170, y + panel
    draw.rectangle((left, top, right, bottom), outline="black")
    draw.text((left, top - 14), "latent cosine against BF16 per step (tuning requests)", fill="black")
    values = [v for curve in trajectories.values() for v in curve if math.isfinite(v)]
    low = min(values, default=0.0)
    low = max(-1.0, low - 0.1 * max(1.0 - low, 1e-6))
    draw.text((8, top - 6), "1.0", fill="black")
    draw.text((8, bottom - 6), f"{low:.4f}", fill="black")
    for index, (label, curve) in enumerate(trajectories.items()):
        colour = COLOURS[index % len(COLOURS)]
        n = len(curve)
        points = [
            (
                left + (right - left) * i / max(n - 1, 1),
                bottom - (bottom - top) * (v - low) / max(1.0 - low, 1e-12),
            )
            for i, v in enumerate(curve)
        ]
        if len(points) > 1:
            draw.line(points, fill=colour, width=2)
        draw.text((right + 10, top + 14 * index), label, fill=colour)
    image.save(path)


def write(out: Path, result: TuneResult) -> dict[str, Any]:
    """Write every file into ``out``; the config."""
    out.mkdir(parents=True, exist_ok=True)
    config = config_of(result)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_csv(out / "scores.csv", unit_rows(result))
    (out / "scores.json").write_text(json.dumps(jsonable(document(result)), indent=2) + "\n")
    n = result.reference_trajectory_len
    trajectories = {
        "bf16": [1.0] * n,
        "all W4A4": result.baseline.trajectory,
        "tuned": result.tuned.trajectory,
    }
    write_png(out / "report.png", result, trajectories)
    return config
