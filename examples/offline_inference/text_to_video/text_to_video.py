"""Text to video with vLLM-Omni and MXFP4 (Wan2.2): one prompt in, one video file out.

    python examples/offline_inference/text_to_video/text_to_video.py \\
        --model /path/to/Wan2.2-T2V-A14B-Diffusers --quantization mxfp4 --output wan22-mxfp4.mp4

    # any mxfp4 / mxfp4_dualscale config, as a JSON string or a JSON file
    python examples/offline_inference/text_to_video/text_to_video.py \\
        --model /path/to/Wan2.2-T2V-A14B-Diffusers \\
        --quantization-config '{"method":"mxfp4","w4a8_fallback_steps":[0,39]}'

    # an offline checkpoint made by `vllm-omni-mxfp4 merge`: no quantization flag, auto-detected
    python examples/offline_inference/text_to_video/text_to_video.py --model /path/to/merged-checkpoint

It builds ``vllm_omni.Omni`` (the ``mxfp4`` / ``mxfp4_dualscale`` methods come from the installed
vllm-omni-mxfp4 plugin; no import needed), generates, and writes an MP4 (or a GIF where no video
encoder is installed). Before generating it prints the platform vLLM-Omni runs on (an accelerator,
or vllm-omni-mxfp4's CPU platform when there is none) and, read from the loaded engine
(:mod:`vllm_omni_mxfp4.inspection.engine`), what each transformer ended up with: every Linear's method,
backend, online/offline mode and precision, and its weight bytes.

Video writing and the parallelism flags come from the demo's package: ``pip install -e examples/demo``
(``scripts/env.sh`` installs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from vllm_omni_mxfp4.compare.run import model_boundary_ratio
from vllm_omni_mxfp4.plugin import engine_quant_config
from vllm_omni_mxfp4_demo.modes import add_parallel_arguments, parallel_kwargs

MIB = 1024 * 1024


def parse_quantization_config(text: str) -> dict[str, Any]:
    """``--quantization-config``: a JSON object, or the path of a file holding one; validated by the
    engine's own code (:func:`vllm_omni_mxfp4.plugin.engine_quant_config`)."""
    if os.path.isfile(text):
        try:
            content = Path(text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise argparse.ArgumentTypeError(f"cannot read {text!r}: {exc}") from None
        where = f"file {text!r}"
    elif text.lstrip().startswith("{"):
        content, where = text, "the JSON string"
    else:
        raise argparse.ArgumentTypeError(
            f'{text!r} is neither a JSON object (e.g. \'{{"method":"mxfp4"}}\') nor an existing JSON file'
        )
    try:
        config = json.loads(content)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"{where} must hold a JSON object, got {type(config).__name__}")
    try:
        # The engine's own build of quantization_config (vLLM-Omni's factory with the plugin
        # registered): accepted here exactly when Omni(...) and `vllm serve --omni` accept it.
        engine_quant_config(config)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"invalid quantization config in {where}: {exc}") from None
    return config


def build_parser() -> argparse.ArgumentParser:
    """The example's command line."""
    parser = argparse.ArgumentParser(
        prog="text_to_video.py",
        description="Generate a video from a text prompt with vLLM-Omni (Wan2.2), optionally with MXFP4.",
    )
    parser.add_argument(
        "--model", required=True, help="Diffusers Wan2.2 text-to-video pipeline (local path or hub id)."
    )
    parser.add_argument("--prompt", default="a cat walking on the grass", help="Text prompt.")
    parser.add_argument("--negative-prompt", default="", help="Negative prompt (default: empty).")
    quant = parser.add_mutually_exclusive_group()
    quant.add_argument(
        "--quantization",
        default=None,
        metavar="METHOD",
        help="Quantization method for the transformers: mxfp4 or mxfp4_dualscale (or another method of your "
        "vLLM-Omni). Omit both quantization flags to auto-detect from each transformer's config.json.",
    )
    quant.add_argument(
        "--quantization-config",
        type=parse_quantization_config,
        default=None,
        metavar="JSON",
        help='A quantization config as a JSON object (e.g. \'{"method":"mxfp4","w4a8_fallback_steps":[0,39]}\', '
        'or per expert: \'{"transformer":"mxfp4","transformer_2":{...}}\') or the path of a JSON file. '
        "Mutually exclusive with --quantization.",
    )
    parser.add_argument("--height", type=int, default=480, help="Video height (default 480).")
    parser.add_argument("--width", type=int, default=832, help="Video width (default 832).")
    parser.add_argument(
        "--num-frames", type=int, default=81, help="Number of frames, 4k+1 for Wan2.2 (default 81)."
    )
    parser.add_argument("--num-inference-steps", type=int, default=40, help="Denoising steps (default 40).")
    parser.add_argument("--seed", type=int, default=42, help="Random seed (default 42).")
    parser.add_argument(
        "--guidance-scale", type=float, default=4.0, help="Classifier-free guidance scale (default 4.0)."
    )
    parser.add_argument(
        "--boundary-ratio",
        type=float,
        default=None,
        help="Wan2.2 switch point from the high-noise to the low-noise expert (default: the model's "
        "model_index.json, else vLLM-Omni's 0.875).",
    )
    parser.add_argument(
        "--fps", type=float, default=16.0, help="Frames per second of the output video (default 16)."
    )
    parser.add_argument(
        "--output",
        default="wan22_output.mp4",
        help="Output video (default wan22_output.mp4). A .gif path, or a machine without an MP4 encoder, gets a GIF.",
    )
    add_parallel_arguments(parser)
    return parser


def omni_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``Omni(...)`` keyword arguments the command line asks for."""
    from vllm_omni_mxfp4.inspection.engine import WORKER_EXTENSION

    kwargs: dict[str, Any] = {
        "model": args.model,
        "dtype": "bfloat16",
        **parallel_kwargs(args),
        # Lets the example ask the workers what each transformer holds (see vllm_omni_mxfp4.inspection.engine).
        "worker_extension_cls": WORKER_EXTENSION,
    }
    if args.quantization is not None:
        kwargs["quantization"] = args.quantization
    if args.quantization_config is not None:
        kwargs["quantization_config"] = args.quantization_config
    boundary = args.boundary_ratio if args.boundary_ratio is not None else model_boundary_ratio(args.model)
    if boundary is not None:
        kwargs["boundary_ratio"] = boundary
    return kwargs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    from vllm_omni_mxfp4.inspection.engine import platform_description, transformer_reports
    from vllm_omni_mxfp4_demo.media import video_frames, write_video

    kwargs = omni_kwargs(args)
    if args.quantization is not None:
        requested = f"--quantization {args.quantization}"
    elif args.quantization_config is not None:
        requested = f"--quantization-config {json.dumps(args.quantization_config)}"
    else:
        requested = "none (each transformer's config.json decides: auto-detection)"
    print(f"Model: {args.model}")
    print(f"Quantization requested: {requested}")
    start = time.perf_counter()
    omni = Omni(**kwargs)
    load_s = time.perf_counter() - start
    try:
        print(f"Platform: {platform_description()}")
        for report in transformer_reports(omni):
            extra = (
                f" (+{report.backend_bytes / MIB:.1f} MiB backend buffers)" if report.backend_bytes else ""
            )
            ranks = f" over {report.ranks} ranks" if report.ranks > 1 else ""
            print(
                f"  {report.name}: {report.summary()}; weights {report.weight_bytes / MIB:.1f} MiB{ranks}{extra}"
            )
        params = OmniDiffusionSamplingParams(
            height=args.height,
            width=args.width,
            num_frames=args.num_frames,
            num_inference_steps=args.num_inference_steps,
            guidance_scale=args.guidance_scale,
            seed=args.seed,
        )
        start = time.perf_counter()
        outputs = omni.generate({"prompt": args.prompt, "negative_prompt": args.negative_prompt}, params)
        gen_s = time.perf_counter() - start
        frames = video_frames(outputs)
    finally:
        omni.shutdown()
    path = write_video(frames, args.output, fps=args.fps)
    print(
        f"Engine started in {load_s:.1f} s; generated {frames.shape[0]} frames of {frames.shape[2]}x{frames.shape[1]} in {gen_s:.1f} s"
    )
    print(f"Saved video to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
