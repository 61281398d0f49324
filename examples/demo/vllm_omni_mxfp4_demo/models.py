"""End to end through ``Omni(...)`` on tiny random pipelines of eight diffusion model families.

    python -m vllm_omni_mxfp4_demo.models [--families wan22_t2v_a14b,flux1_dev,...]
        [--modes bf16,mxfp4,dualscale] [--steps 2] [--out outputs/models] [--json PATH]

For each family of :data:`FAMILIES` it builds the tiny pipeline (:mod:`vllm_omni_mxfp4_tiny`,
cached), then generates one prompt and seed through vLLM-Omni's own pipeline class for that model
once per mode — BF16 (the reference), ``mxfp4`` and ``mxfp4_dualscale`` online, as the demo's
:data:`~vllm_omni_mxfp4_demo.modes.MODES` define them — each engine in a process of its own
(:func:`~vllm_omni_mxfp4_tiny.runner.run_engine_job`). It prints PSNR and cosine similarity of each
quantized output against BF16 and how many of each transformer's Linears ran each method (read from
the running engine), and writes the numbers as JSON (``<out>/models_e2e.json``, or ``--json``;
``docs/models_e2e.json`` is the copy the docs and the model table read).

A family that cannot run end to end with our methods carries the reason (:attr:`Family.unsupported`);
it is listed in the JSON with that reason, never silently left out (its builder stays, for the test
that watches the reason).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_omni_mxfp4.compare import metrics
from vllm_omni_mxfp4_tiny.engine_job import Job
from vllm_omni_mxfp4_tiny.runner import run_engine_job

from .modes import MODES, Mode

PROG = "python -m vllm_omni_mxfp4_demo.models"
DEFAULT_OUT = "outputs/models"
DEFAULT_MODES = ("bf16", "mxfp4", "dualscale")
PROMPT = "a red bird flying over the blue sea"
SEED = 0


def _wan(experts: int) -> Callable[[], Path]:
    def build() -> Path:
        from vllm_omni_mxfp4_tiny.wan import build_tiny_wan

        return build_tiny_wan(experts)

    return build


def _variant(name: str) -> Callable[[], Path]:
    def build() -> Path:
        from vllm_omni_mxfp4_tiny.wan import build_tiny_wan_variant

        return build_tiny_wan_variant(name)

    return build


def _builder(module: str, function: str) -> Callable[[], Path]:
    def build() -> Path:
        import importlib

        return getattr(importlib.import_module(f"vllm_omni_mxfp4_tiny.{module}"), function)()

    return build


@dataclass(frozen=True)
class Family:
    """One model family: its tiny pipeline and the request that runs it."""

    key: str
    title: str
    build: Callable[[], Path]
    height: int = 64
    width: int = 64
    num_frames: int = 1
    guidance_scale: float = 4.0
    image: bool = False  # an input image (image-to-video)
    unsupported: str | None = None  # why the family is not run (then run_family returns only this)

    def job(self, model: Path, out: Path, mode: Mode, steps: int, image: Path | None) -> Job:
        """The engine job of ``mode`` on ``model`` (report on: the Linears' methods are recorded)."""
        return Job(
            model=str(model),
            out=str(out),
            omni_kwargs=mode.omni_kwargs(steps),
            seeds=[SEED],
            prompt=PROMPT,
            height=self.height,
            width=self.width,
            num_frames=self.num_frames,
            steps=steps,
            guidance_scale=self.guidance_scale,
            report=True,
            image=str(image) if self.image and image is not None else None,
        )


FAMILIES: tuple[Family, ...] = (
    Family("wan22_t2v_a14b", "Wan2.2 T2V-A14B", _wan(2), 32, 32, 5, 5.0),
    Family("wan22_i2v_a14b", "Wan2.2 I2V-A14B", _variant("i2v"), 32, 32, 5, 5.0, image=True),
    Family("wan22_ti2v_5b", "Wan2.2 TI2V-5B", _variant("ti2v"), 32, 32, 5, 5.0),
    Family("qwen_image", "Qwen-Image", _builder("qwen_image", "build_tiny_qwen_image")),
    Family("flux1_dev", "FLUX.1-dev", _builder("flux", "build_tiny_flux"), guidance_scale=3.5),
    Family("flux2_klein", "FLUX.2-klein", _builder("flux2_klein", "build_tiny_flux2_klein")),
    Family(
        "hunyuan_video_15",
        "HunyuanVideo-1.5",
        _builder("hunyuan_video", "build_tiny_hunyuan_video"),
        32,
        32,
        5,
        6.0,
    ),
    Family("z_image", "Z-Image", _builder("z_image", "build_tiny_z_image")),
)
FAMILY_KEYS = tuple(f.key for f in FAMILIES)


def input_image(path: Path, height: int, width: int) -> Path:
    """Write the image-to-video families' input: a deterministic colour gradient PNG."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels.astype(np.uint8)).save(path)
    return path


def linear_methods(result: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per transformer of an engine job's report: how many of its Linears ran each method."""
    return {
        t["name"]: dict(sorted(Counter(entry["method"] for entry in t["linears"]).items()))
        for t in result.get("transformers", [])
    }


def _number(value: float) -> float | str:
    """A JSON-safe number: ``inf`` / ``nan`` as strings (JSON has neither)."""
    return round(value, 5) if math.isfinite(value) else str(value)


def run_family(
    family: Family,
    out: Path,
    modes: list[Mode],
    steps: int,
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``family`` once per mode (BF16 first) and return its record for the JSON table.

    Each mode's record: PSNR and cosine of its output against BF16, the Linears' methods per
    transformer, engine start and generation seconds. ``env``: the engines' environment (default
    this process'). Raises
    :class:`~vllm_omni_mxfp4_tiny.runner.RunFailed` when an engine fails.
    """
    if family.unsupported is not None:
        return {"title": family.title, "unsupported": family.unsupported}
    model = family.build()
    image = input_image(out / family.key / "input.png", family.height, family.width) if family.image else None
    record: dict[str, Any] = {
        "title": family.title,
        "pipeline": json.loads((model / "model_index.json").read_text())["_class_name"],
        "request": {
            "height": family.height,
            "width": family.width,
            "num_frames": family.num_frames,
            "steps": steps,
            "guidance_scale": family.guidance_scale,
            "seed": SEED,
        },
        "modes": {},
    }
    reference = None
    for mode in modes:
        run_dir = out / family.key / mode.name
        result = run_engine_job(family.job(model, run_dir, mode, steps, image), timeout=timeout, env=env)
        frames = np.load(run_dir / "frames_0.npy")
        reference = frames if reference is None else reference
        record["modes"][mode.name] = {
            "description": mode.description,
            "psnr_db": _number(metrics.psnr(frames, reference)),
            "cosine": _number(metrics.cosine(frames, reference)),
            "linears": linear_methods(result),
            "load_s": round(result["load_s"], 1),
            "gen_s": round(result["gen_s"][0], 2),
        }
    return record


def _cell(value: float | str, digits: int) -> str:
    return value if isinstance(value, str) else f"{value:.{digits}f}"


def format_table(records: dict[str, dict[str, Any]]) -> str:
    """The printed table: one line per family and mode (PSNR / cosine vs BF16, Linears' methods)."""
    lines = [f"{'family':<18} {'mode':<10} {'PSNR dB':>8} {'cosine':>8}  Linears (per transformer)"]
    lines.append("-" * len(lines[0]))
    for record in records.values():
        if "unsupported" in record:
            lines.append(f"{record['title']:<18} not run: {record['unsupported']}")
            continue
        for name, mode in record["modes"].items():
            methods = "; ".join(
                f"{t}: " + ", ".join(f"{n} {m}" for m, n in counts.items())
                for t, counts in mode["linears"].items()
            )
            psnr, cosine = _cell(mode["psnr_db"], 2), _cell(mode["cosine"], 5)
            lines.append(f"{record['title']:<18} {name:<10} {psnr:>8} {cosine:>8}  {methods}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m vllm_omni_mxfp4_demo.models``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="End to end through Omni(...) on tiny random pipelines of eight diffusion model families.",
    )
    parser.add_argument(
        "--families",
        default=",".join(FAMILY_KEYS),
        help=f"Comma-separated families (default: all): {', '.join(FAMILY_KEYS)}.",
    )
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help="Comma-separated modes of the demo's table (bf16, mxfp4, dualscale, ...); bf16 always runs first.",
    )
    parser.add_argument("--steps", type=int, default=2, help="Denoising steps (default 2).")
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="Output directory: engine logs and outputs per family and mode.",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="Where to write the results (default: OUT/models_e2e.json)."
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="Seconds one engine run (start + generation) may take."
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="Keep the other families' records of an existing --json file (re-run some families only).",
    )
    return parser


def _choose(parser: argparse.ArgumentParser, text: str, known: tuple[str, ...], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(f"--{what}: unknown {unknown or 'none given'}; choose from {', '.join(known)}")
    return names


def main(argv: list[str] | None = None) -> int:
    """Run the chosen families and modes, print the table, write the JSON; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    keys = _choose(parser, args.families, FAMILY_KEYS, "families")
    wanted = set(_choose(parser, args.modes, tuple(m.name for m in MODES), "modes")) | {"bf16"}
    modes = [m for m in MODES if m.name in wanted]
    records = {}
    for family in (f for f in FAMILIES if f.key in keys):
        print(f"[models] {family.title}: {', '.join(m.name for m in modes)}", flush=True)
        records[family.key] = run_family(family, args.out, modes, args.steps, args.timeout)
    print(format_table(records))
    path = args.json or args.out / "models_e2e.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.update and path.is_file():
        records = {**json.loads(path.read_text())["families"], **records}
    records = {key: records[key] for key in FAMILY_KEYS if key in records}
    table = {"generated_by": f"{PROG} --steps {args.steps}", "prompt": PROMPT, "families": records}
    path.write_text(json.dumps(table, indent=2) + "\n")
    print(f"[models] results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
