"""The quantized video demo: one prompt through BF16 and every MXFP4 mode, compared frame by frame.

    python -m vllm_omni_mxfp4_demo [--modes bf16,mxfp4,...] [--steps N] [--out outputs/demo]
    python -m vllm_omni_mxfp4_demo --model /path/to/Wan2.2-T2V-A14B-Diffusers [--quant-path EXPORT]
    python -m vllm_omni_mxfp4_demo --random-weights

By default it runs the trained tiny two-expert Wan2.2 the demo distribution ships
(:mod:`vllm_omni_mxfp4_tiny.trained_wan`; its files are checked against the SHA-256 its manifest
records): it draws the prompted shapes, and prompt accuracy is scored. ``--model`` runs another
pipeline (a trained tiny one, the Wan2.2 or the FLUX.1-dev text-to-image the demo also ships, is
recognized by the command its manifest records: :mod:`vllm_omni_mxfp4_demo.trained`),
``--random-weights`` the tiny pipeline with random weights (seconds to build, noise for frames).
Then it:

1. quantizes it offline with msModelSlim and merges the export into a diffusers checkpoint
   (:mod:`vllm_omni_mxfp4_demo.offline`), merges the exports of msModelSlim's shipped recipes, and
   writes an NVFP4 copy that the ``nvfp4`` mode serves requantized;
2. generates the same prompt and seed through ``vllm_omni.Omni`` once per mode
   (:data:`~vllm_omni_mxfp4_demo.modes.MODES`), each engine in a process of its own
   (:mod:`vllm_omni_mxfp4_tiny.engine_job`, run by :mod:`vllm_omni_mxfp4_tiny.runner`), and with the
   same engine, for a trained tiny model, the fixed prompt-accuracy set
   (:mod:`vllm_omni_mxfp4_demo.accuracy`);
3. prints a table — PSNR and cosine similarity of the frames against BF16, prompt accuracy on seen
   and held-out prompts (trained tiny model), the transformers' weight bytes in memory, engine start
   and generation time — and writes one video per mode, a PNG strip of frames of every mode, and the numbers as JSON and
   Markdown (:mod:`vllm_omni_mxfp4_demo.report`).

With ``--model PATH`` the same modes run on that checkpoint on whatever platform vLLM-Omni finds
(an accelerator, else the CPU platform); the offline mode then needs ``--quant-path`` (an existing
msModelSlim export of that model) and is skipped without it, except for a trained tiny model, which
the demo quantizes itself as it does the random one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from vllm_omni_mxfp4.compare.run import model_boundary_ratio
from vllm_omni_mxfp4_tiny.engine_job import Job
from vllm_omni_mxfp4_tiny.runner import RunFailed, end_running_commands, run_engine_job
from vllm_omni_mxfp4_tiny.trained_wan import SHIPPED
from vllm_omni_mxfp4_tiny.training_command import MANIFEST, verify_manifest

from . import nvfp4_quality, report
from .media import video_frames
from .modes import PROG, Mode, build_parser, parallel_kwargs, resolve_defaults
from .offline import SAME_CHECKPOINT, nvfp4_checkpoint, offline_checkpoint, recipe_checkpoint
from .trained import TrainedModel, trained_model


class Progress:
    """Timestamped progress lines on the console (through tqdm, so a progress bar stays intact)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def say(self, message: str) -> None:
        tqdm.write(f"[demo {time.perf_counter() - self.started:6.1f}s] {message}")


@dataclass
class DemoRun:
    """One run of the demo: the command line, the resolved model and sizes, and what the modes produced."""

    args: argparse.Namespace
    model: Path
    out: Path
    modes: list[Mode]
    size: dict[str, int]  # height, width, num_frames, steps
    trained: TrainedModel | None = None  # the kind of trained tiny pipeline the model is, if it is one
    engines: int = 1  # engines that run at once
    engine_env: dict[str, str] | None = None  # their environment (None: this process')
    offline_model: Path | None = None
    recipe_models: dict[str, Path] = field(default_factory=dict)  # mode name -> merged checkpoint
    nvfp4_model: Path | None = None
    failed_early: dict[str, str] = field(default_factory=dict)
    results: list[dict[str, Any]] = field(default_factory=list)
    frames: dict[str, np.ndarray] = field(default_factory=dict)
    evaluation_frames: dict[str, np.ndarray] = field(default_factory=dict)  # the prompt-accuracy set's
    other_seed_frames: np.ndarray | None = None


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _model(args: argparse.Namespace, progress: Progress) -> tuple[Path, TrainedModel | None] | int:
    """The pipeline directory to run and the kind of trained tiny pipeline it is (None: not one), or
    exit status 2: ``--model``, else the trained tiny Wan2.2 the demo distribution ships, or with
    ``--random-weights`` the random-weight one (built on first use)."""
    if args.random_weights:
        from vllm_omni_mxfp4_tiny import build_tiny_wan

        if args.model is not None:
            return _error("--random-weights and --model: give one (--random-weights builds its own model)")
        if args.quant_path is not None:
            progress.say("--quant-path ignored: the demo quantizes the tiny model itself")
        progress.say(
            "building (or reusing) the tiny two-expert Wan2.2 text-to-video pipeline, random weights"
        )
        model = build_tiny_wan(2)
        progress.say(f"model: {model}")
        return model, None
    if args.model is None:
        model = SHIPPED
        if not (model / MANIFEST).is_file():
            return _error(
                f"the trained tiny Wan2.2 is not in this checkout ({model}); train it with "
                "`python -m vllm_omni_mxfp4_tiny.trained_wan`, or run --random-weights"
            )
        if args.quant_path is not None:
            progress.say("--quant-path ignored: the demo quantizes the trained tiny model itself")
    else:
        model = Path(args.model).expanduser().absolute()
    if not (model / "model_index.json").is_file():
        return _error(f"--model {model}: not a diffusers pipeline directory (no model_index.json)")
    if args.quant_path is not None and not Path(args.quant_path).expanduser().is_dir():
        return _error(f"--quant-path {args.quant_path}: no such directory")
    try:
        trained = trained_model(model)
        if trained is not None:
            verify_manifest(model)
    except ValueError as exc:
        return _error(f"--model {model}: {exc}")
    if trained is not None:
        progress.say(f"model: {trained.label} ({model / MANIFEST}): task defaults, prompt accuracy scored")
    return model, trained


def _own_exports(run: DemoRun) -> bool:
    """Whether the demo makes the msModelSlim exports itself: for the tiny Wan2.2 models (random or
    trained), which msModelSlim quantizes on the CPU in seconds."""
    return run.args.random_weights or (run.trained is not None and run.trained.wan_exports)


def _skip_unsupported(run: DemoRun, progress: Progress) -> None:
    """Drop the modes a trained tiny pipeline other than Wan2.2 cannot run, each with its reason: the
    checkpoints the demo makes for Wan2.2 only (its msModelSlim exports, the shipped Wan2.2 recipes,
    the NVFP4 copy; the offline mode stays when ``--quant-path`` gives an export to merge), and W4A8
    by step where the pipeline publishes no denoising step."""
    trained = run.trained
    if trained is None:
        return
    reasons: dict[str, str] = {}
    if not trained.wan_exports:
        for m in run.modes:
            if m.recipe is not None or m.nvfp4 or (m.offline and run.args.quant_path is None):
                reasons[m.name] = "the demo makes its msModelSlim exports and NVFP4 copy for Wan2.2 only"
    if not trained.publishes_steps:
        for m in run.modes:
            if _step_fallback(m, run.size["steps"]):
                reasons[m.name] = (
                    "W4A8 by step needs the denoising step, which vLLM-Omni's pipeline of this model does not "
                    "publish (the engine refuses the config at start-up; W4A8 by layer works)"
                )
    for reason in dict.fromkeys(reasons.values()):
        names = ", ".join(name for name, r in reasons.items() if r == reason)
        progress.say(f"{names} skipped: {reason}, and the model is {trained.label}")
    run.modes = [m for m in run.modes if m.name not in reasons]


def _step_fallback(mode: Mode, steps: int) -> bool:
    """Whether ``mode`` runs W4A8 on some denoising steps."""
    config = mode.omni_kwargs(steps).get("quantization_config")
    return isinstance(config, dict) and bool(config.get("w4a8_fallback_steps"))


def _offline_step(run: DemoRun, progress: Progress) -> None:
    """Make the offline mode's checkpoint; a failure fails that mode only, a missing export skips it."""
    if not any(m.offline for m in run.modes):
        return
    if not _own_exports(run) and run.args.quant_path is None:
        progress.say(
            "offline mode skipped: --model without --quant-path (give an msModelSlim export of the model)"
        )
        run.modes = [m for m in run.modes if not m.offline]
        return
    quant_path = None if _own_exports(run) else Path(run.args.quant_path).expanduser().absolute()
    try:
        run.offline_model = offline_checkpoint(
            run.model, quant_path, run.out, progress.say, calibrate=run.trained is not None
        )
    except Exception as exc:  # the other modes still run; the summary reports this one
        run.failed_early["offline"] = f"offline step failed: {type(exc).__name__}: {exc}"
        progress.say(f"offline: FAILED: {run.failed_early['offline']}")


def _recipe_step(run: DemoRun, progress: Progress) -> None:
    """Make each recipe mode's checkpoint (tiny model only); a failure fails that mode only."""
    recipes = [m for m in run.modes if m.recipe is not None]
    if recipes and not _own_exports(run):
        progress.say(
            "recipe modes skipped with --model: run `msmodelslim quant` with the recipe on the NPU, merge it "
            "(docs/user_guide.md) and run that checkpoint"
        )
        run.modes = [m for m in run.modes if m.recipe is None]
        return
    made: dict[str, Path] = {}
    for mode in recipes:
        source = SAME_CHECKPOINT.get(mode.recipe, mode.recipe)
        try:
            if source not in made:
                made[source] = recipe_checkpoint(run.model, source, run.out, progress.say)
            if source != mode.recipe:
                progress.say(f"{mode.name}: runs the {source} checkpoint (same Linears; FA3 is not merged)")
            run.recipe_models[mode.name] = made[source]
        except Exception as exc:  # the other modes still run; the summary reports this one
            run.failed_early[mode.name] = f"recipe step failed: {type(exc).__name__}: {exc}"
            progress.say(f"{mode.name}: FAILED: {run.failed_early[mode.name]}")


def _nvfp4_step(run: DemoRun, progress: Progress) -> None:
    """Make the nvfp4 mode's checkpoint (tiny models only); a failure fails that mode only."""
    modes = [m for m in run.modes if m.nvfp4]
    if not modes:
        return
    if not _own_exports(run):
        progress.say("nvfp4 mode skipped with --model: serve an NVFP4 checkpoint with --quantization mxfp4")
        run.modes = [m for m in run.modes if not m.nvfp4]
        return
    try:
        run.nvfp4_model = nvfp4_checkpoint(run.model, run.out, progress.say)
    except Exception as exc:  # the other modes still run; the summary reports this one
        for mode in modes:
            run.failed_early[mode.name] = f"NVFP4 step failed: {type(exc).__name__}: {exc}"
            progress.say(f"{mode.name}: FAILED: {run.failed_early[mode.name]}")


def _mode_model(run: DemoRun, mode: Mode) -> Path:
    if mode.nvfp4:
        return run.nvfp4_model or run.model
    if mode.recipe is not None:
        return run.recipe_models.get(mode.name, run.model)
    return run.offline_model if mode.offline else run.model


def _job(run: DemoRun, mode: Mode, kwargs: dict[str, Any]) -> Job:
    seed = run.args.seed
    return Job(
        model=str(_mode_model(run, mode)),
        out=str(run.out / "runs" / mode.name),
        omni_kwargs={**parallel_kwargs(run.args), **kwargs},
        # The reference engine also renders another seed: how far apart two different videos are.
        seeds=[seed, seed + 1] if mode.name == "bf16" else [seed],
        prompt=run.args.prompt,
        negative_prompt=run.args.negative_prompt,
        guidance_scale=run.args.guidance_scale,
        guidance_scale_2=run.args.guidance_scale_2,
        boundary_ratio=model_boundary_ratio(run.model),
        report=True,
        evaluation=run.trained.accuracy.job_requests(run.args.accuracy_seeds) if run.trained else [],
        naive_w4a4=mode.naive_w4a4,
        **run.size,
    )


def _run_mode(run: DemoRun, mode: Mode, entry: dict[str, Any], tag: str, progress: Progress) -> None:
    """Run one mode's engine and fill its ``entry`` (numbers, or the error) and frames in ``run``."""
    kwargs = entry["omni_kwargs"]
    job = _job(run, mode, kwargs)
    shutil.rmtree(job.out, ignore_errors=True)
    if mode.name in run.failed_early:
        entry["error"] = run.failed_early[mode.name]
        return
    arguments = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "no quantization argument"
    progress.say(f"{tag}: Omni(model=..., {arguments})")
    try:
        result = run_engine_job(job, timeout=run.args.timeout, allow_leftovers=True, env=run.engine_env)
    except RunFailed as exc:
        entry["error"] = f"{exc.reason} (log: {exc.log}): " + " | ".join(exc.tail(3))
        progress.say(f"{tag}: FAILED: {entry['error']}")
        return
    transformers = result["transformers"]
    entry.update(
        load_s=result["load_s"],
        gen_s=result["gen_s"][0],
        platform=result["platform_description"],
        **{
            key: sum(t[key] for t in transformers)
            for key in ("weight_bytes", "backend_bytes", "kernel_bytes")
        },
        transformers=transformers,
    )
    if "naive_w4a4" in result:  # the plain Linears the bad configuration made W4A4, per transformer
        entry["naive_w4a4"] = result["naive_w4a4"]
    run.frames[mode.name] = video_frames(np.load(Path(job.out) / "frames_0.npy"))
    if job.evaluation and run.trained is not None:
        outputs = np.stack([video_frames(v) for v in np.load(Path(job.out) / "evaluation.npy")])
        entry["accuracy"] = run.trained.accuracy.score(outputs, run.args.accuracy_seeds)
        run.evaluation_frames[mode.name] = outputs
        entry["evaluation_s"] = result["evaluation_s"]
    if len(job.seeds) > 1:
        run.other_seed_frames = video_frames(np.load(Path(job.out) / "frames_1.npy"))
    progress.say(f"{tag}: engine started in {result['load_s']:.1f} s, generated in {entry['gen_s']:.2f} s")


def _reuse_twin(run: DemoRun, mode: Mode, entry: dict[str, Any], tag: str, progress: Progress) -> bool:
    """Fill ``entry`` from the finished run of the earlier mode with the same checkpoint and arguments
    (:func:`_same_engine_run`), if there is one: a second engine would give the same numbers."""
    twin = _same_engine_run(run, mode, entry["omni_kwargs"])
    if twin is None:
        return False
    entry.update(
        {k: v for k, v in twin.items() if k not in ("mode", "description")}, same_run_as=twin["mode"]
    )
    entry["description"] += f"; its numbers are {twin['mode']}'s run (same checkpoint and arguments)"
    run.frames[mode.name] = run.frames[twin["mode"]]
    progress.say(f"{tag}: the checkpoint and arguments of {twin['mode']}: its run (no second engine)")
    return True


def _same_engine_run(run: DemoRun, mode: Mode, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The finished entry of an earlier mode of ``run`` that ran the checkpoint ``mode`` runs with the
    same arguments (a recipe of :data:`SAME_CHECKPOINT`), if any."""
    if mode.recipe not in SAME_CHECKPOINT:
        return None
    twin = next((m for m in run.modes if m.recipe == SAME_CHECKPOINT[mode.recipe]), None)
    if twin is None or _mode_model(run, twin) != _mode_model(run, mode):
        return None
    entry = next((e for e in run.results if e["mode"] == twin.name), None)
    if entry is None or "error" in entry or entry.get("omni_kwargs") != kwargs or twin.name not in run.frames:
        return None
    return entry


def engine_threads(engines: int) -> int:
    """Threads each of ``engines`` engines running at once computes with: this process' cores shared."""
    return max(1, len(os.sched_getaffinity(0)) // engines)


def _engines(args: argparse.Namespace, run: DemoRun) -> tuple[int, dict[str, str] | None]:
    """How many engines run at once and their environment. ``--engines``, else two for the tiny models
    (random or trained) and one for another model. With more than one, each engine gets its share of
    the cores as ``OMP_NUM_THREADS`` (unless the environment sets it): the tiny models' small matrix
    products run faster on one thread each than on two (measured: an mxfp4 engine's 12-video set in
    8.5 s with one thread, 11.9 s with two), so two engines at a time finish in well under half."""
    engines = args.engines or (min(2, len(os.sched_getaffinity(0))) if _tiny(run) else 1)
    if engines == 1 or "OMP_NUM_THREADS" in os.environ:
        return engines, None
    return engines, {**os.environ, "OMP_NUM_THREADS": str(engine_threads(engines))}


def _tiny(run: DemoRun) -> bool:
    return bool(run.args.random_weights) or run.trained is not None


def _needs_export(mode: Mode) -> bool:
    """Whether ``mode`` runs a checkpoint the demo makes first (offline, recipe, NVFP4)."""
    return mode.offline or mode.recipe is not None or mode.nvfp4


def _prepare(run: DemoRun, progress: Progress) -> None:
    """Make the checkpoints of the modes that need one (each failure fails its modes only)."""
    _offline_step(run, progress)
    _recipe_step(run, progress)
    _nvfp4_step(run, progress)


def _run_modes(run: DemoRun, progress: Progress) -> None:
    """Make the exports and run every mode's engine, ``run.engines`` at a time (each with its share of
    the cores): the modes that need no export start while the exports are made, the others once
    they are; the modes that may reuse another's run (:data:`SAME_CHECKPOINT`) last. Entries keep
    the modes' order whatever finishes first. An interrupt ends the running engines."""
    size = run.size
    image = run.trained is not None and run.trained.accuracy.kind == "image"
    what = "an image" if image else f"{size['num_frames']} frames"
    lanes = f", {run.engines} at a time" if run.engines > 1 else ""
    progress.say(
        f"generating {what} of {size['width']}x{size['height']}, {size['steps']} steps, "
        f"seed {run.args.seed}, prompt {run.args.prompt!r}, in {len(run.modes)} modes (one engine process "
        f"each{lanes}; logs under {run.out / 'runs'})"
    )
    entries = {
        m.name: {"mode": m.name, "description": m.description, "omni_kwargs": m.omni_kwargs(size["steps"])}
        for m in run.modes
    }
    tags = {m.name: f"({n}/{len(run.modes)}) {m.name}" for n, m in enumerate(run.modes, start=1)}
    requested = list(run.modes)
    run.results.extend(entries[m.name] for m in requested)
    bar = tqdm(
        total=len(requested),
        desc="modes",
        unit="mode",
        file=sys.stderr,
        leave=False,
        disable=not sys.stderr.isatty(),
    )

    def submit(pool: ThreadPoolExecutor, modes: list[Mode]) -> list[Future]:
        return [pool.submit(_run_mode, run, m, entries[m.name], tags[m.name], progress) for m in modes]

    def finish(futures: list[Future]) -> None:
        for future in as_completed(futures):
            future.result()
            bar.update(1)

    with ThreadPoolExecutor(max_workers=run.engines, thread_name_prefix="demo-mode") as pool:
        try:
            exports = pool.submit(_prepare, run, progress)
            running = submit(pool, [m for m in requested if not _needs_export(m)])
            exports.result()  # run.modes now lacks the modes a step skipped
            bar.update(len(requested) - len(run.modes))
            later = [m for m in run.modes if m.recipe in SAME_CHECKPOINT]
            finish(running + submit(pool, [m for m in run.modes if _needs_export(m) and m not in later]))
            reused = [m for m in later if _reuse_twin(run, m, entries[m.name], tags[m.name], progress)]
            bar.update(len(reused))
            finish(submit(pool, [m for m in later if m not in reused]))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            end_running_commands()
            raise
    bar.close()
    kept = {m.name for m in run.modes}  # a step skipped the others
    run.results[:] = [entry for entry in run.results if entry["mode"] in kept]


def _finish(run: DemoRun, progress: Progress) -> int:
    """Score, write and print the report; 1 when a mode failed."""
    keys = ("prompt", "negative_prompt", "seed", "guidance_scale", "guidance_scale_2")
    settings = {k: getattr(run.args, k) for k in keys}
    summary = report.Summary(run.out, run.model, run.offline_model, settings, run.results)
    report.score(run.results, run.frames, run.evaluation_frames)
    report.write_media(summary, run.frames)
    summary.other_seed = report.other_seed(run.frames.get("bf16"), run.other_seed_frames, run.args.seed + 1)
    if (
        run.args.random_weights
    ):  # the random tiny model: NVFP4 sources next to MXFP4 (docs/nvfp4.md, "Quality")
        progress.say("NVFP4 quality: the tiny transformer's output with each format emulated")
        summary.nvfp4_quality = nvfp4_quality.measure()
    report.publish(summary)
    failed = summary.failed
    progress.say(
        f"done in {time.perf_counter() - progress.started:.1f} s"
        + (f"; FAILED modes: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    """Run the demo the parsed command line describes; returns the exit status."""
    progress = Progress()
    found = _model(args, progress)
    if isinstance(found, int):
        return found
    model, trained = found
    size = resolve_defaults(args, trained)
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    demo = DemoRun(args, model, out, list(args.modes), size, trained=trained)
    demo.engines, demo.engine_env = _engines(args, demo)
    if demo.engine_env is not None:  # the exports are made beside the engines: their share of the cores
        import torch

        torch.set_num_threads(int(demo.engine_env["OMP_NUM_THREADS"]))
    _skip_unsupported(demo, progress)
    _run_modes(demo, progress)
    return _finish(demo, progress)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM -> SystemExit, so that a running engine process group is ended on the way out."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """The demo's entry point; returns the exit status (0 ok, 1 a mode failed, 2 bad arguments)."""
    args = build_parser().parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return run(args)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
