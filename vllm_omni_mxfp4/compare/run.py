"""Run one model under several quantization configs on the same prompts and seeds, BF16 first.

Each config gets its own ``Omni(...)`` engine (vLLM-Omni's real pipeline on whatever platform is
present, this package's kernels), built with the transformer-report worker extension (weight bytes)
and with ``VLLM_OMNI_MXFP4_TRAJECTORY_DIR`` pointing at a fresh directory, so that its workers save
every denoising step's latents (:mod:`vllm_omni_mxfp4.hooks.trajectory`). Each (prompt, seed) is one
``generate`` call: its steps are the files that call wrote. :func:`compare` returns what
:mod:`.report` turns into numbers, JSON and a PNG.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from .. import envs
from ..config import parse_quantization
from ..inspection.engine import WORKER_EXTENSION, transformer_reports
from ..plugin import engine_quant_config

logger = logging.getLogger(__name__)

BF16 = "bf16"
"""The label of the reference run (no quantization argument; a checkpoint's own config applies)."""


@dataclass(frozen=True)
class Request:
    """One generation: a prompt and a seed."""

    prompt: str
    seed: int


@dataclass(frozen=True)
class Settings:
    """The generation settings every config runs with."""

    steps: int
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None  # Wan2.2's low-noise expert
    negative_prompt: str = ""
    image: str | None = None  # the input image of an image-to-video pipeline (a file path)


@dataclass(frozen=True)
class Config:
    """One configuration: its label and its ``Omni(...)`` keyword arguments."""

    label: str
    omni_kwargs: dict[str, Any]


@dataclass
class ConfigRun:
    """What one config's engine produced: per request its frames and its steps' latents."""

    config: Config
    frames: list[np.ndarray] = field(default_factory=list)
    trajectories: list[list[np.ndarray]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    start_seconds: float = 0.0
    weight_bytes: int = 0


def parse_config(text: str, index: int) -> Config:
    """A ``--config`` value: a method name (``mxfp4``), an inline JSON object (a flat config, or a
    per-component one as ``tune`` writes), or ``@file.json``; optionally ``label=`` in front.
    ``ValueError`` naming the value otherwise."""
    label, sep, spec = text.partition("=")
    if not sep or label.strip().startswith(("{", "@")):
        label, spec = "", text
    spec = spec.strip()
    if spec.startswith("@"):
        path = Path(spec[1:]).expanduser()
        try:
            spec = path.read_text()
        except OSError as exc:
            raise ValueError(f"--config {text!r}: cannot read {path}: {exc.strerror}") from None
    if spec.startswith("{"):
        try:
            value = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--config {text!r}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(value, dict):
            raise ValueError(f"--config {text!r}: expected a JSON object (a flat or a per-component config)")
        try:
            parse_quantization(value)  # flat ({"method": ...}) or per component ({"transformer": ...})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--config {text!r}: {exc}") from None
        kwargs: dict[str, Any] = {"quantization_config": value}
        method = value.get("method", value.get("quant_method"))
        method = method if isinstance(method, str) else "per-component"
    elif spec and spec.replace("_", "").isalnum():
        kwargs, method = {"quantization": spec}, spec
    else:
        raise ValueError(
            f'--config {text!r}: expected a method name (mxfp4), a JSON object ({{"method": "mxfp4", ...}}) '
            "or @file.json, optionally after label="
        )
    label = label.strip() or f"{method}-{index}"
    if label == BF16:
        raise ValueError(f"--config {text!r}: the label {BF16!r} is the reference's; choose another")
    return Config(label, kwargs)


def check_config(config: Config) -> None:
    """Build ``config``'s quantization config as the engine would (no engine, no weights), so that a
    bad config is refused before the first engine starts; ``ValueError`` naming the label."""
    spec = config.omni_kwargs.get("quantization_config", config.omni_kwargs.get("quantization"))
    try:
        engine_quant_config(spec)
    except Exception as exc:  # the factory's own error, whatever its type
        raise ValueError(f"--config {config.label}: the engine refuses it: {exc}") from exc


def frames_of(images: list[Any]) -> np.ndarray:
    """An output's ``images`` as one float32 array in ``[0, 1]``: ``images[0]`` when it is an array of
    frames (Wan2.2), all PIL images stacked otherwise (image pipelines)."""
    if not hasattr(images[0], "getbands"):
        return np.asarray(images[0], dtype=np.float32)
    return np.stack([np.asarray(image, dtype=np.float32) for image in images]) / np.float32(255.0)


def sampling_params(settings: Settings, seed: int) -> Any:
    """vLLM-Omni's sampling parameters of one generation under ``settings``."""
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    given = {
        "height": settings.height,
        "width": settings.width,
        "num_frames": settings.num_frames,
        "guidance_scale": settings.guidance_scale,
        "guidance_scale_2": settings.guidance_scale_2,
    }
    return OmniDiffusionSamplingParams(
        num_inference_steps=settings.steps, seed=seed, **{k: v for k, v in given.items() if v is not None}
    )


def take_steps(directory: Path) -> list[np.ndarray]:
    """The latents the engine saved since the directory was last emptied, in step order; emptied."""
    paths = sorted(directory.glob("*.npy"))
    steps = [np.load(path) for path in paths]
    for path in paths:
        path.unlink()
    return steps


def engine_kwargs(model: str, config: Config) -> dict[str, Any]:
    """``Omni(model=model, ...)``'s keyword arguments for ``config``: the report extension, a two-expert
    pipeline's ``boundary_ratio`` from its ``model_index.json`` (vLLM-Omni does not read it there)."""
    kwargs: dict[str, Any] = {"worker_extension_cls": WORKER_EXTENSION}
    boundary = model_boundary_ratio(model)
    if boundary is not None:
        kwargs["boundary_ratio"] = boundary
    return {**kwargs, **config.omni_kwargs}


def model_boundary_ratio(model: str | Path) -> float | None:
    """The ``boundary_ratio`` of a local diffusers pipeline's ``model_index.json``, if it has one."""
    index = Path(model) / "model_index.json"
    if not index.is_file():
        return None
    value = json.loads(index.read_text()).get("boundary_ratio")
    return float(value) if value is not None else None


@contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set process environment variables for the ``with`` block (an engine's worker processes inherit
    them when they start), then restore them."""
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def generate(omni: Any, request: Request, settings: Settings) -> Any:
    """One generation of ``request`` under ``settings``; vLLM-Omni's first output."""
    prompt: dict[str, Any] = {"prompt": request.prompt, "negative_prompt": settings.negative_prompt}
    if settings.image is not None:
        prompt["multi_modal_data"] = {"image": settings.image}
    return omni.generate(prompt, sampling_params(settings, request.seed))[0]


def run_config(
    model: str, config: Config, requests: Sequence[Request], settings: Settings, work: Path
) -> ConfigRun:
    """Build ``config``'s engine, run every request, shut the engine down."""
    from vllm_omni import Omni

    trajectory = fresh_dir(work / config.label)
    run = ConfigRun(config)
    with environment({envs.TRAJECTORY_DIR.name: str(trajectory)}):
        start = time.perf_counter()
        omni = Omni(model=model, **engine_kwargs(model, config))
        run.start_seconds = time.perf_counter() - start
        try:
            run.weight_bytes = sum(t.weight_bytes for t in transformer_reports(omni))
            take_steps(trajectory)  # the engine's warm-up request
            for request in tqdm(requests, desc=config.label, unit="generation", leave=False):
                start = time.perf_counter()
                output = generate(omni, request, settings)
                run.seconds.append(time.perf_counter() - start)
                run.frames.append(frames_of(output.images))
                run.trajectories.append(take_steps(trajectory))
        finally:
            omni.shutdown()
    if not any(run.trajectories):
        logger.warning(
            "%s: the pipeline recorded no denoising step (it does not step through vLLM-Omni's "
            "scheduler_step_maybe_with_cfg); per-step measures are missing",
            config.label,
        )
    return run


def fresh_dir(path: Path) -> Path:
    """``path`` as a new empty directory."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def compare(
    model: str,
    configs: Sequence[Config],
    requests: Sequence[Request],
    settings: Settings,
    work: Path,
    progress: Callable[[str], None] = logger.info,
) -> list[ConfigRun]:
    """BF16 then every config, each on every request; the runs in that order."""
    if not requests:
        raise ValueError("compare needs at least one prompt and one seed")
    labels = [c.label for c in configs]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ValueError(f"config labels {duplicates} are given twice; label each --config (label=...)")
    for config in configs:
        check_config(config)
    runs = []
    for config in (Config(BF16, {}), *configs):
        progress(f"{config.label}: Omni(model=..., {config.omni_kwargs or 'no quantization argument'})")
        run = run_config(model, config, requests, settings, work)
        progress(
            f"{config.label}: engine started in {run.start_seconds:.1f} s, {len(requests)} generation(s) in "
            f"{sum(run.seconds):.1f} s"
        )
        runs.append(run)
    return runs
