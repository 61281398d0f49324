"""The demo's modes (how each run builds ``Omni(...)``) and its command line.

:data:`MODES` is the table the demo runs, in order: BF16 (the reference) and every MXFP4 way of
running the same model. :func:`build_parser` is ``python -m vllm_omni_mxfp4_demo``'s command line;
:func:`add_parallel_arguments` adds the parallelism flags it shares with the text-to-video example.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .accuracy import IMAGE, VIDEO
from .trained import FLUX, WAN, TrainedModel

PROG = "python -m vllm_omni_mxfp4_demo"
DEFAULT_OUT = "outputs/demo"
#: Generation defaults. A trained tiny pipeline (a directory with a training manifest) runs with its
#: own (vllm_omni_mxfp4_demo.trained: a prompt it was trained on, a seed training never used).
#: --random-weights: the embedded tiny pipeline with random weights.
TINY_DEFAULTS: dict[str, Any] = {
    "height": 64,
    "width": 64,
    "num_frames": 17,
    "steps": 20,
    "prompt": "a cat walking on the grass",
    "negative_prompt": "blurry low quality",
    "seed": 42,
    "guidance_scale": 5.0,
    "guidance_scale_2": None,
}
#: A real Wan2.2 checkpoint (the user guide's settings).
MODEL_DEFAULTS: dict[str, Any] = {**TINY_DEFAULTS, "height": 480, "width": 832, "num_frames": 81, "steps": 40}
SIZE_KEYS = ("height", "width", "num_frames", "steps")


def resolve_defaults(args: argparse.Namespace, trained: TrainedModel | None) -> dict[str, int]:
    """Fill every generation option left unset on ``args`` with the defaults of its model (``trained``:
    the kind of trained tiny pipeline it is, if it is one); returns the size keys the engine jobs take."""
    if trained is not None:
        defaults = trained.defaults
    else:
        defaults = TINY_DEFAULTS if args.random_weights else MODEL_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return {key: getattr(args, key) for key in SIZE_KEYS}


@dataclass(frozen=True)
class Mode:
    """A way to run the model: a name, what it means, and its ``Omni(...)`` arguments; ``offline``
    runs the merged export of the demo's own recipe, ``recipe`` the merged export of one of
    msModelSlim's shipped recipes (:data:`vllm_omni_mxfp4_tiny.msmodelslim_recipes.RECIPES`),
    ``naive_w4a4`` also makes the Linears vLLM-Omni keeps in BF16 W4A4 (a bad configuration), ``nvfp4``
    runs an NVFP4 copy of the model."""

    name: str
    description: str
    omni_kwargs: Callable[[int], dict[str, Any]]  # steps -> kwargs
    offline: bool = False
    recipe: str | None = None
    naive_w4a4: bool = False  # W4A4 on the plain Linears too (vllm_omni_mxfp4_tiny.naive_w4a4)
    nvfp4: bool = False  # runs an NVFP4 copy of the model (offline.nvfp4_checkpoint)
    default: bool = True  # runs without --modes; False: only when --modes names it


def _last_steps(steps: int) -> list[int]:
    return sorted({0, steps - 1})


MODES: tuple[Mode, ...] = (
    Mode("bf16", "BF16, no quantization (the reference)", lambda steps: {}),
    Mode("mxfp4", "mxfp4 online, OCP scale rule", lambda steps: {"quantization": "mxfp4"}),
    Mode(
        "naive-w4a4",
        "a bad configuration, for contrast: mxfp4 online plus W4A4 (emulated) on the Linears vLLM-Omni "
        "keeps in BF16 (time, timestep-projection and text embedders, proj_out), no fallback anywhere",
        lambda steps: {"quantization": "mxfp4"},
        naive_w4a4=True,
    ),
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
        "merged msModelSlim checkpoint (mxfp4_dualscale offline; Smooth calibrated on training prompts for a "
        "trained model), no quantization argument: auto-detected",
        lambda steps: {},
        offline=True,
    ),
    Mode(
        "wan-w4a4f4",
        "msModelSlim's shipped Wan2.2 recipe wan2_2_w4a4f4_mxfp_t2v (W8A8 MXFP8 blocks 0-4, W4A4 MXFP4 "
        "after: the random tiny model's 2 blocks are all MXFP8, a trained tiny model's 6 keep block 5 W4A4; "
        "QuaRot and FA3 left out, attention BF16), merged, auto-detected",
        lambda steps: {},
        recipe="w4a4f4",
    ),
    Mode(
        "wan-w4a4f8",
        "msModelSlim's shipped Wan2.2 recipe wan2_2_w4a4f8_mxfp_t2v: the Linears of w4a4f4, so the same "
        "merged checkpoint (only its FA3 differs: FP8, which vLLM-Omni runs in BF16)",
        lambda steps: {},
        recipe="w4a4f8",
    ),
    Mode(
        "nvfp4",
        "an NVFP4 checkpoint of the model (block Linears packed by compressed-tensors) served with "
        "quantization=mxfp4: requantized to MXFP4 while it loads",
        lambda steps: {"quantization": "mxfp4"},
        nvfp4=True,
    ),
    Mode(
        "msmodelslim-svd16",
        "msModelSlim's svd_res (rank 16) then W4A4 MXFP4 on every block Linear, no Smooth, ascendv1 saver "
        "(vllm_omni_mxfp4_tiny/recipes), merged (W4A4_MXFP4_SVD: the pair stored next to the residual), "
        "auto-detected; not in the default run",
        lambda steps: {},
        recipe="svd16",
        default=False,
    ),
    *(
        Mode(
            f"mxfp4-svd{rank}",
            f"mxfp4 online with a rank-{rank} low-rank branch (svd_rank {rank}: the pair in BF16, the residual "
            "quantized); not in the default run",
            lambda steps, rank=rank: {"quantization_config": {"method": "mxfp4", "svd_rank": rank}},
            default=False,
        )
        for rank in (8, 16, 32)
    ),
)
MODE_NAMES = tuple(m.name for m in MODES)
DEFAULT_MODE_NAMES = tuple(m.name for m in MODES if m.default)


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


def positive_int(text: str) -> int:
    """An argparse type: a positive integer, else a message naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tensor-parallel-size``, ``--ulysses-degree``, ``--cfg-parallel-size``, ``--enforce-eager``."""
    parser.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="Tensor-parallel ranks of the transformer (default 1).",
    )
    parser.add_argument(
        "--ulysses-degree",
        type=positive_int,
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


def parallel_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``Omni(...)`` arguments of the flags :func:`add_parallel_arguments` adds."""
    return {
        "tensor_parallel_size": args.tensor_parallel_size,
        "ulysses_degree": args.ulysses_degree,
        "cfg_parallel_size": args.cfg_parallel_size,
        "enforce_eager": args.enforce_eager,
    }


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="A diffusers Wan2.2 text-to-video pipeline directory. Default: the trained tiny two-expert "
        "pipeline the demo ships (vllm_omni_mxfp4_tiny/trained/wan22_t2v). A trained tiny pipeline (its "
        "TRAINING.json is checked) runs with the task's defaults and adds prompt accuracy: the shipped "
        "Wan2.2, or the shipped FLUX.1-dev text-to-image one (vllm_omni_mxfp4_tiny/trained/flux1_dev_t2i; "
        "its offline, recipe and nvfp4 modes are skipped: the demo makes those exports for Wan2.2 only).",
    )
    parser.add_argument(
        "--accuracy-seeds",
        type=positive_int,
        default=1,
        help="Seeds per prompt of the prompt-accuracy set a trained tiny model generates in every mode "
        f"({VIDEO.seen} seen and {VIDEO.held_out} held-out prompts for the Wan2.2, {IMAGE.seen} and "
        f"{IMAGE.held_out} for the FLUX.1-dev; default 1).",
    )
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="Run the embedded tiny pipeline with random weights instead (built on first use; fast, but "
        "its frames are noise): the plumbing without the pictures.",
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
        default=",".join(DEFAULT_MODE_NAMES),
        help=f"Comma-separated subset of {','.join(MODE_NAMES)} (default: {','.join(DEFAULT_MODE_NAMES)}). "
        "bf16 always runs: it is the reference.",
    )


def _default_help(key: str) -> str:
    return (
        f"the trained tiny Wan2.2 (the default): {WAN.defaults[key]!r}, the trained tiny FLUX.1-dev: "
        f"{FLUX.defaults[key]!r}, --random-weights: "
        f"{TINY_DEFAULTS[key]!r}, another --model: {MODEL_DEFAULTS[key]!r}"
    )


def _add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--steps", type=positive_int, default=None, help=f"Denoising steps ({_default_help('steps')})."
    )
    parser.add_argument(
        "--height", type=positive_int, default=None, help=f"Frame height ({_default_help('height')})."
    )
    parser.add_argument(
        "--width", type=positive_int, default=None, help=f"Frame width ({_default_help('width')})."
    )
    parser.add_argument(
        "--num-frames",
        type=positive_int,
        default=None,
        help=f"Frames, 4k+1 for Wan2.2 ({_default_help('num_frames')}).",
    )
    parser.add_argument("--seed", type=int, default=None, help=f"Generation seed ({_default_help('seed')}).")
    parser.add_argument("--prompt", default=None, help=f"Prompt ({_default_help('prompt')}).")
    parser.add_argument(
        "--negative-prompt", default=None, help=f"Negative prompt ({_default_help('negative_prompt')})."
    )
    parser.add_argument(
        "--guidance-scale",
        type=float,
        default=None,
        help=f"Classifier-free guidance scale; of the high-noise expert where a second is given "
        f"({_default_help('guidance_scale')}).",
    )
    parser.add_argument(
        "--guidance-scale-2",
        type=float,
        default=None,
        help="Guidance scale of the low-noise expert (Wan2.2's guidance_scale_2; None: the value of --guidance-scale) "
        f"({_default_help('guidance_scale_2')}).",
    )


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Quantized text-to-video demo: runs the trained tiny two-expert Wan2.2 pipeline it ships (or "
            "--model), quantizes it offline with msModelSlim and merges it, generates one prompt with BF16 "
            "and every MXFP4 mode through vllm_omni.Omni, and prints PSNR / cosine against BF16, prompt "
            "accuracy (trained tiny model), transformer weight bytes and timings; writes one video per mode "
            "and a PNG strip of frames."
        ),
        epilog="Modes: " + "; ".join(f"{m.name}: {m.description}" for m in MODES),
    )
    _add_model_arguments(parser)
    _add_generation_arguments(parser)
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help=f"Output directory (default {DEFAULT_OUT}); the demo's files in it are replaced.",
    )
    add_parallel_arguments(parser)
    parser.add_argument(
        "--engines",
        type=positive_int,
        default=None,
        help="Engines (one per mode) that run at once, each with its share of the cores as OMP_NUM_THREADS "
        "(default: 2 for the tiny models, whose small matrix products run faster on one thread each; 1 "
        "for another --model).",
    )
    parser.add_argument(
        "--timeout",
        type=positive_int,
        default=1800,
        help="Seconds one mode (engine start + generation) may take before it is stopped (default 1800).",
    )
    return parser
