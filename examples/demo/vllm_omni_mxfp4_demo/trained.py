"""The trained tiny pipelines the demo knows, told apart by the command their manifest records.

A pipeline directory with a training manifest (``TRAINING.json``, written by
``python -m vllm_omni_mxfp4_tiny.trained_wan`` or ``...trained_flux``) runs as its training
evaluated it (:attr:`TrainedModel.defaults`: sizes, steps, guidance, a prompt it was trained on, a
seed training never used) and every mode also generates its prompt-accuracy set
(:attr:`TrainedModel.accuracy`). The demo's own msModelSlim exports, the shipped recipes and the
NVFP4 copy are made for Wan2.2's module tree only (:attr:`TrainedModel.wan_exports`), and W4A8 by
step needs a pipeline that publishes its denoising step (:attr:`TrainedModel.publishes_steps`:
vLLM-Omni 0.30's Wan2.2 pipelines do, its FLUX.1-dev pipeline does not, and the engine refuses the
config at start-up); the image model runs the other online modes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni_mxfp4_tiny import trained_flux, trained_wan, training_command
from vllm_omni_mxfp4_tiny.task import TRAINING_SEEDS

from . import accuracy


@dataclass(frozen=True)
class TrainedModel:
    """One kind of trained tiny pipeline: what it is, the command that trains it, its generation
    defaults, its prompt-accuracy set, whether the demo's Wan2.2 exports apply to it and whether its
    vLLM-Omni pipeline publishes the denoising step (``ForwardContext.denoise_step_idx``)."""

    label: str
    command: str
    defaults: dict[str, Any]
    accuracy: accuracy.AccuracySet
    wan_exports: bool
    publishes_steps: bool


WAN = TrainedModel(
    label="a trained tiny Wan2.2 T2V",
    command=trained_wan.COMMAND,
    defaults={
        "height": trained_wan.HEIGHT,
        "width": trained_wan.WIDTH,
        "num_frames": trained_wan.NUM_FRAMES,
        "steps": trained_wan.EVAL_STEPS,
        "prompt": "a red bar moving right quickly on a black background",
        "negative_prompt": "",  # the unconditional branch it learned
        "seed": TRAINING_SEEDS,
        "guidance_scale": trained_wan.EVAL_GUIDANCE,
        "guidance_scale_2": trained_wan.EVAL_GUIDANCE_2,
    },
    accuracy=accuracy.VIDEO,
    wan_exports=True,
    publishes_steps=True,
)

FLUX = TrainedModel(
    label="a trained tiny FLUX.1-dev text-to-image",
    command=trained_flux.COMMAND,
    defaults={
        "height": trained_flux.HEIGHT,
        "width": trained_flux.WIDTH,
        "num_frames": 1,
        "steps": trained_flux.EVAL_STEPS,
        "prompt": "a red square at the top left on a black background",
        "negative_prompt": "",  # FLUX.1-dev's guidance is distilled: no negative branch runs
        "seed": TRAINING_SEEDS,
        "guidance_scale": trained_flux.GUIDANCE,
        "guidance_scale_2": None,
    },
    accuracy=accuracy.IMAGE,
    wan_exports=False,
    publishes_steps=False,
)

KINDS: tuple[TrainedModel, ...] = (WAN, FLUX)


def trained_model(model: Path) -> TrainedModel | None:
    """The kind of trained tiny pipeline ``model`` is (its manifest's ``command``), None without a
    manifest; a ``ValueError`` naming the file for a manifest the demo cannot read or does not know."""
    path = Path(model) / training_command.MANIFEST
    if not path.is_file():
        return None
    try:
        command = json.loads(path.read_text()).get("command")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a training manifest (JSON object expected): {exc}") from None
    for kind in KINDS:
        if command == kind.command:
            return kind
    raise ValueError(
        f"{path}: command {command!r} is none of the demo's trained pipelines "
        f"({', '.join(repr(k.command) for k in KINDS)}); retrain it with one of them"
    )
