"""The numbers of a comparison (per step, per request, per config), its JSON, PNG and summary table.

Per denoising step: the cosine and MSE of a config's latents against BF16's at the same step
(upstream's ``compare_diffusion_trajectory_similarity`` measures). On the final frames: PSNR, SSIM and
cosine against BF16's frames (:mod:`.metrics`), and prompt accuracy where an installed task metric
knows the model (:data:`TASK_METRICS`). Means over the requests; every request's numbers
are in the JSON too. The PNG (drawn with Pillow, which vLLM installs) puts the mean per-step cosine
curves above one frame strip per config.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import numpy as np

from . import metrics
from .run import BF16, ConfigRun, Request, Settings

COLOURS = (
    (0, 0, 0),
    (214, 39, 40),
    (31, 119, 180),
    (44, 160, 44),
    (255, 127, 14),
    (148, 103, 189),
    (140, 86, 75),
)
"""Line colours of the configs in the PNG, BF16 first (black)."""


def _number(value: float) -> float | str:
    """JSON has no inf or nan: those become strings."""
    return value if math.isfinite(value) else str(value)


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return float(np.mean(finite)) if finite else math.nan


def step_measures(steps: list[np.ndarray], reference: list[np.ndarray]) -> list[dict[str, float]]:
    """Cosine and MSE of each step's latents against the reference's same step. Runs that took a
    different number of steps are compared over the steps both have."""
    return [
        {"step": i, "cosine": metrics.latent_cosine(a, b), "mse": metrics.mse(a, b)}
        for i, (a, b) in enumerate(zip(steps, reference))
    ]


def frame_measures(frames: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """PSNR, SSIM and cosine of the final frames against the reference's."""
    return {
        "psnr": metrics.psnr(frames, reference),
        "ssim": metrics.ssim(frames, reference),
        "cosine": metrics.cosine(frames, reference),
    }


TASK_METRICS = "vllm_omni_mxfp4.task_metrics"
"""Entry-point group of task metrics: ``metric(model) -> judge | None``, ``judge(prompt, frames) ->
{attribute: shown} | None`` (None: not a prompt of its task). The demo's tiny models register theirs."""

Judge = Callable[[str, np.ndarray], "dict[str, bool] | None"]


def task_judge(model: str) -> Judge | None:
    """The judge of the first installed task metric that knows ``model``, or None."""
    for entry in entry_points(group=TASK_METRICS):
        judge = entry.load()(model)
        if judge is not None:
            return judge
    return None


def _accuracy(per_request: list[dict[str, Any]]) -> float | None:
    """The share of judged requests whose output shows every attribute of its prompt."""
    judged = [r["task"] for r in per_request if r.get("task") is not None]
    return sum(all(t.values()) for t in judged) / len(judged) if judged else None


def measure(
    runs: list[ConfigRun], requests: Sequence[Request], judge: Judge | None = None
) -> list[dict[str, Any]]:
    """Every config's numbers against the first run (BF16); ``judge``: prompt accuracy too."""
    reference = runs[0]
    out = []
    for run in runs:
        per_request = []
        for i, request in enumerate(requests):
            per_request.append(
                {
                    "prompt": request.prompt,
                    "seed": request.seed,
                    **frame_measures(run.frames[i], reference.frames[i]),
                    "task": None if judge is None else judge(request.prompt, run.frames[i]),
                    "seconds": run.seconds[i],
                    "steps": step_measures(run.trajectories[i], reference.trajectories[i]),
                }
            )
        n_steps = min((len(r["steps"]) for r in per_request), default=0)
        steps = [
            {
                key: (i if key == "step" else _mean([r["steps"][i][key] for r in per_request]))
                for key in ("step", "cosine", "mse")
            }
            for i in range(n_steps)
        ]
        out.append(
            {
                "label": run.config.label,
                "reference": run is reference,
                "omni_kwargs": run.config.omni_kwargs,
                "weight_bytes": run.weight_bytes,
                "start_seconds": run.start_seconds,
                "seconds": _mean(run.seconds),
                "final": {key: _mean([r[key] for r in per_request]) for key in ("psnr", "ssim", "cosine")},
                "prompt_accuracy": _accuracy(per_request),
                "steps": steps,
                "per_request": per_request,
            }
        )
    return out


def jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    return value


def write_json(
    path: Path, model: str, settings: Settings, requests: Sequence[Request], configs: list[dict]
) -> None:
    """``compare.json``: the model, the settings, the requests and every config's numbers."""
    document = {
        "model": model,
        "settings": vars(settings),
        "requests": [vars(r) for r in requests],
        "configs": configs,
    }
    path.write_text(json.dumps(jsonable(document), indent=2) + "\n")


def summary_table(configs: list[dict]) -> str:
    """One line per config: final PSNR, SSIM, cosine, the last and worst step's latent cosine, bytes, time."""
    head = (
        f"{'config':<20} {'PSNR dB':>8} {'SSIM':>7} {'cosine':>8} {'last step':>10} {'worst step':>11} "
        f"{'accuracy':>9} {'MiB':>8} {'gen s':>7}"
    )
    lines = [head]
    for c in configs:
        final, steps = c["final"], c["steps"]
        worst = min(steps, key=lambda s: s["cosine"]) if steps else None
        last = f"{steps[-1]['cosine']:.5f}" if steps else "-"
        worst_text = f"{worst['cosine']:.5f}@{worst['step']}" if worst else "-"
        accuracy = "-" if c["prompt_accuracy"] is None else f"{c['prompt_accuracy']:.0%}"
        lines.append(
            f"{c['label']:<20} {final['psnr']:>8.2f} {final['ssim']:>7.4f} {final['cosine']:>8.5f} {last:>10} "
            f"{worst_text:>11} {accuracy:>9} {c['weight_bytes'] / 2**20:>8.2f} {c['seconds']:>7.2f}"
        )
    return "\n".join(lines)


def _strip(frames: np.ndarray, height: int, count: int = 4) -> np.ndarray:
    """Up to ``count`` frames spread over the video (or the image), each scaled to ``height``, side by
    side, as uint8 RGB."""
    video = frames.reshape(-1, *frames.shape[-3:])  # (F, H, W, C)
    picks = np.unique(np.linspace(0, len(video) - 1, min(count, len(video))).round().astype(int))
    scale = max(1, height // video.shape[1])
    tiles = [np.kron(video[i], np.ones((scale, scale, 1))) for i in picks]
    return (np.clip(np.concatenate(tiles, axis=1), 0.0, 1.0) * 255).round().astype(np.uint8)


def write_png(path: Path, runs: list[ConfigRun], configs: list[dict]) -> None:
    """The mean per-step latent cosine of every config (BF16's line is 1) above one frame strip per
    config (its first request)."""
    from PIL import Image, ImageDraw

    strips = [_strip(run.frames[0], 96) for run in runs]
    label_w, pad = 150, 8
    width = max(640, label_w + max(s.shape[1] for s in strips) + pad)
    chart_h = 260
    height = chart_h + sum(s.shape[0] + pad for s in strips) + pad
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = 60, 20, width - 170, chart_h - 30
    cosines = [s["cosine"] for c in configs for s in c["steps"] if not math.isnan(s["cosine"])]
    low = min(cosines) if cosines else 0.0
    low = max(-1.0, low - 0.1 * max(1.0 - low, 1e-6))
    draw.rectangle((left, top, right, bottom), outline="black")
    draw.text((left, 4), "mean cosine of the latents against BF16's, per denoising step", fill="black")
    draw.text((pad, top - 6), "1.0", fill="black")
    draw.text((pad, bottom - 6), f"{low:.5f}", fill="black")
    n = max((len(c["steps"]) for c in configs), default=0)
    draw.text(((left + right) // 2 - 40, bottom + 8), f"denoising step (0..{max(n - 1, 0)})", fill="black")
    for index, c in enumerate(configs):
        colour = COLOURS[index % len(COLOURS)]
        points = [
            (
                left + (right - left) * s["step"] / max(n - 1, 1),
                bottom - (bottom - top) * (s["cosine"] - low) / max(1.0 - low, 1e-12),
            )
            for s in c["steps"]
            if not math.isnan(s["cosine"])
        ]
        if len(points) > 1:
            draw.line(points, fill=colour, width=2)
        draw.text((right + 10, top + 14 * index), c["label"], fill=colour)
    y = chart_h
    for index, (run, strip) in enumerate(zip(runs, strips)):
        draw.text((pad, y + strip.shape[0] // 2 - 6), run.config.label, fill=COLOURS[index % len(COLOURS)])
        image.paste(Image.fromarray(strip), (label_w, y))
        y += strip.shape[0] + pad
    image.save(path)


def write(
    out: Path, model: str, settings: Settings, requests: Sequence[Request], runs: list[ConfigRun]
) -> list[dict]:
    """Measure ``runs`` (BF16 first) and write ``compare.json`` and ``compare.png`` into ``out``."""
    if not runs or runs[0].config.label != BF16:
        raise ValueError("the first run must be the BF16 reference")
    configs = measure(runs, requests, task_judge(model))
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "compare.json", model, settings, requests, configs)
    write_png(out / "compare.png", runs, configs)
    return configs
