"""Run vLLM-Omni's ``Omni`` once and save its frames: the one engine program of the demo and the tests.

    python -m vllm_omni_mxfp4_tiny.engine_job JOB.json

``JOB.json`` holds the fields of :class:`Job` (only ``model`` and ``out`` are required). The job
builds ``Omni(model=..., dtype="bfloat16", **omni_kwargs)``, sends one request per seed through
that one engine (with ``lora``, request ``i`` carries the LoRA adapter ``lora[i]`` names, or none:
:func:`lora_request`), and writes into ``out``:

- ``frames_<i>.npy``: request ``i``'s ``images[0]`` exactly as ``Omni.generate`` returns it
  (float32 ``(1, F, H, W, 3)`` in ``[0, 1]`` for Wan2.2); pipelines that return PIL images (one
  per image, or one per frame as HunyuanVideo-1.5 does) get all of ``images`` stacked as float32
  ``(N, H, W, C)`` in ``[0, 1]`` (the 8-bit values / 255);
- ``result.json``: ``load_s`` (engine construction), ``gen_s`` (one entry per request),
  ``platform`` (the qualified class of vLLM-Omni's current platform) and ``platform_description``,
  ``outputs`` (per request: seed, output count, ``final_output_type``, Python type, dtype, shape)
  and, with ``report``, ``transformers``: what each transformer of the running engine holds
  (:mod:`vllm_omni_mxfp4.inspection.engine`);
- with ``evaluation`` (``[prompt, seed]`` pairs), ``evaluation.npy``: one video per pair, stacked in
  order (float32 ``(N, F, H, W, 3)``), generated after the seeds with the job's other settings, and
  ``evaluation_s`` in ``result.json`` (their total generation time). The pairs of one seed go to
  ``Omni.generate`` together and the engine batches them (``max_num_seqs``, :func:`engine_kwargs`):
  each request still draws its noise from its own seed, so a video is the one a request of its own
  would give (the tests check that), at about half the time on two cores. The demo scores them with
  the task's detector (prompt accuracy);
- with ``naive_w4a4``, ``naive_w4a4`` in ``result.json``: the plain Linears made W4A4 before any
  request, per transformer (:mod:`vllm_omni_mxfp4_tiny.naive_w4a4`).

It always runs in a process of its own (:func:`vllm_omni_mxfp4_tiny.runner.run_engine_job`), so
that every engine starts fresh, its memory is its own, and its worker processes can be reaped.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_omni_mxfp4.compare.run import frames_of, model_boundary_ratio


@dataclass(frozen=True)
class Job:
    """One engine and its requests. ``boundary_ratio`` None means the model's ``model_index.json`` value."""

    model: str
    out: str
    omni_kwargs: dict[str, Any] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=lambda: [0])
    prompt: str = "a cat walking on the grass"
    negative_prompt: str = "blurry low quality"
    height: int = 16
    width: int = 16
    num_frames: int = 9
    steps: int = 2
    guidance_scale: float = 5.0
    guidance_scale_2: float | None = None  # the low-noise expert's (Wan2.2); None: guidance_scale
    boundary_ratio: float | None = None
    report: bool = False
    image: str | None = None  # input image file of image-to-video pipelines (multi_modal_data)
    evaluation: list[tuple[str, int]] = field(default_factory=list)  # (prompt, seed) requests
    naive_w4a4: bool = False  # also W4A4 on the plain Linears (the demo's bad configuration, .naive_w4a4)
    lora: list[tuple[str, float] | None] = field(default_factory=list)
    """Per request (one entry per seed; empty: no request names one): ``[adapter_dir, scale]``, the
    peft LoRA adapter the request carries and its scale, or None for a request that carries none
    (vLLM-Omni then switches any active adapter off, the one of ``omni_kwargs["lora_path"]`` too).
    The ``evaluation`` requests carry none."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Job:
        """A job from its JSON form; unknown or missing keys are an error that names them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        missing = sorted({"model", "out"} - set(data))
        if unknown or missing:
            raise ValueError(
                f"engine job: unknown keys {unknown}, missing keys {missing}; the keys are {sorted(names)}"
            )
        job = cls(**data)
        for index, pair in enumerate(job.evaluation):
            if not (
                isinstance(pair, (list, tuple))
                and len(pair) == 2
                and isinstance(pair[0], str)
                and isinstance(pair[1], int)
                and not isinstance(pair[1], bool)
                and pair[1] >= 0
            ):
                raise ValueError(
                    f"engine job: evaluation[{index}] is {pair!r}; expected [prompt, seed] with a seed >= 0"
                )
        evaluation_groups(job.evaluation)  # a repeated pair is an error
        if job.lora and len(job.lora) != len(job.seeds):
            raise ValueError(
                f"engine job: lora has {len(job.lora)} entries for {len(job.seeds)} seeds; expected one per seed"
            )
        for index, entry in enumerate(job.lora):
            if entry is not None and not (
                isinstance(entry, (list, tuple))
                and len(entry) == 2
                and isinstance(entry[0], str)
                and entry[0]
                and isinstance(entry[1], (int, float))
                and not isinstance(entry[1], bool)
                and entry[1] >= 0
            ):
                raise ValueError(
                    f"engine job: lora[{index}] is {entry!r}; expected null or [adapter_dir, scale] with a scale >= 0"
                )
        return job


def engine_kwargs(job: Job) -> dict[str, Any]:
    """The keyword arguments of ``Omni(model=job.model, ...)``."""
    from vllm_omni_mxfp4.inspection.engine import WORKER_EXTENSION

    kwargs: dict[str, Any] = {"dtype": "bfloat16", **job.omni_kwargs}
    if job.evaluation and "max_num_seqs" not in kwargs:
        kwargs["max_num_seqs"] = max(len(texts) for texts in evaluation_groups(job.evaluation).values())
    boundary = job.boundary_ratio if job.boundary_ratio is not None else model_boundary_ratio(job.model)
    if boundary is not None:
        kwargs["boundary_ratio"] = boundary
    if job.naive_w4a4:
        from .naive_w4a4 import EXTENSION

        kwargs["worker_extension_cls"] = EXTENSION  # it answers the reports too
    elif job.report:
        kwargs["worker_extension_cls"] = WORKER_EXTENSION
    return kwargs


def evaluation_groups(evaluation: list[tuple[str, int]]) -> dict[int, list[str]]:
    """The evaluation prompts by seed, in first-seen order; a (prompt, seed) pair given twice is an error
    (its two videos would be the same one)."""
    groups: dict[int, list[str]] = {}
    for index, (text, seed) in enumerate(evaluation):
        texts = groups.setdefault(seed, [])
        if text in texts:
            raise ValueError(f"engine job: evaluation[{index}] repeats the pair ({text!r}, {seed})")
        texts.append(text)
    return groups


def lora_request(path: str) -> Any:
    """vLLM's ``LoRARequest`` for the adapter directory ``path``.

    Its id is vLLM-Omni's ``stable_lora_int_id(path)``, the id the engine gives the adapter of
    ``Omni(lora_path=path)`` at start-up, so a request naming that same path string selects the
    adapter already loaded instead of loading it again under another id."""
    from vllm_omni.lora.request import LoRARequest
    from vllm_omni.lora.utils import stable_lora_int_id

    return LoRARequest(lora_name=Path(path).name, lora_int_id=stable_lora_int_id(path), lora_path=path)


def _params(job: Job, seed: int, lora: tuple[str, float] | None = None) -> Any:
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    extra: dict[str, Any] = {}
    if lora is not None:
        extra = {"lora_request": lora_request(lora[0]), "lora_scale": float(lora[1])}
    return OmniDiffusionSamplingParams(
        height=job.height,
        width=job.width,
        num_frames=job.num_frames,
        num_inference_steps=job.steps,
        guidance_scale=job.guidance_scale,
        guidance_scale_2=job.guidance_scale_2,
        seed=seed,
        **extra,
    )


def _prompt(job: Job, text: str) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt": text, "negative_prompt": job.negative_prompt}
    if job.image is not None:
        prompt["multi_modal_data"] = {"image": job.image}
    return prompt


def _generate(omni: Any, job: Job, index: int) -> list[Any]:
    lora = job.lora[index] if job.lora else None
    return omni.generate(_prompt(job, job.prompt), _params(job, job.seeds[index], lora))


def _evaluate(omni: Any, job: Job) -> Any:
    """Every ``job.evaluation`` video, in order: one ``Omni.generate`` call per seed with all its prompts."""
    import numpy as np

    videos: dict[tuple[str, int], Any] = {}
    for seed, texts in evaluation_groups(job.evaluation).items():
        outputs = omni.generate([_prompt(job, text) for text in texts], _params(job, seed), use_tqdm=False)
        for output in outputs:
            prompt = output.prompt.get("prompt") if isinstance(output.prompt, dict) else output.prompt
            if prompt not in texts or (prompt, seed) in videos:
                raise RuntimeError(
                    f"engine job: an output for seed {seed} answers prompt {prompt!r}; expected one per {texts}"
                )
            videos[prompt, seed] = frames_of(output.images)
        missing = [text for text in texts if (text, seed) not in videos]
        if missing:
            raise RuntimeError(f"engine job: no output for seed {seed} and prompts {missing}")
    return np.stack([videos[text, seed] for text, seed in job.evaluation])


def _describe(outputs: list[Any], seed: int) -> dict[str, Any]:
    frames = frames_of(outputs[0].images)
    return {
        "seed": seed,
        "count": len(outputs),
        "final_output_type": outputs[0].final_output_type,
        "python_type": type(outputs[0].images[0]).__name__,
        "dtype": str(frames.dtype),
        "shape": list(frames.shape),
    }


def _platform() -> dict[str, str]:
    from vllm_omni.platforms import current_omni_platform

    from vllm_omni_mxfp4.inspection.engine import platform_description

    cls = type(current_omni_platform)
    return {
        "platform": f"{cls.__module__}.{cls.__qualname__}",
        "platform_description": platform_description(),
    }


def run_job(job: Job) -> dict[str, Any]:
    """Build the engine, run every request, save the frames; returns the result (also ``result.json``)."""
    import numpy as np
    from vllm_omni import Omni

    from vllm_omni_mxfp4.inspection.engine import transformer_reports

    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    omni = Omni(model=job.model, **engine_kwargs(job))
    result: dict[str, Any] = {"load_s": time.perf_counter() - start, "gen_s": [], "outputs": []}
    try:
        if job.naive_w4a4:
            from . import naive_w4a4

            result["naive_w4a4"] = naive_w4a4.apply(omni)
        if job.report:
            result["transformers"] = [dataclasses.asdict(r) for r in transformer_reports(omni)]
        for index, seed in enumerate(job.seeds):
            start = time.perf_counter()
            outputs = _generate(omni, job, index)
            result["gen_s"].append(time.perf_counter() - start)
            result["outputs"].append(_describe(outputs, seed))
            np.save(out / f"frames_{index}.npy", frames_of(outputs[0].images))
        if job.evaluation:
            start = time.perf_counter()
            videos = _evaluate(omni, job)
            result["evaluation_s"] = time.perf_counter() - start
            np.save(out / "evaluation.npy", videos)
        result.update(_platform())
    finally:
        omni.shutdown()
    (out / "result.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_omni_mxfp4_tiny.engine_job JOB.json``; returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m vllm_omni_mxfp4_tiny.engine_job JOB.json", file=sys.stderr)
        return 2
    run_job(Job.from_dict(json.loads(Path(args[0]).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
