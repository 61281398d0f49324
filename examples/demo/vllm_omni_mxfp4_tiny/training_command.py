"""What every trained tiny pipeline's training command shares (``python -m
vllm_omni_mxfp4_tiny.trained_wan``, ``...trained_flux``): the command line (``--out``, default the
shipped copy; ``--quick``, a smoke run refused over the shipped copy; the pinned thread count and CPU
kernels), the records of its manifest (recipe, stage times, final losses, prompt accuracy, library
versions, CPU kernels, SHA-256 of every file) and the summary printed at the end."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MANIFEST = "TRAINING.json"
"""The file next to a trained pipeline: recipe, measured numbers, SHA-256 of every other file."""

THREADS = 2
"""Threads every training command computes with, whatever the machine has: a float sum is grouped by
thread, so another count trains other weights (the tiny FLUX.1-dev's recipe with one thread: 92.7 %
seen-prompt accuracy, with two: 87.7 %). The manifest records the count; the shipped weights used it."""

CPU_KERNELS: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""The widest SIMD kernels ATen and oneDNN may pick on x86-64, pinned (to AVX2) by every training
command. Like the thread count, the kernels decide the weights: left to choose, both take AVX-512
kernels where the CPU has them, which group their sums differently, and the previous Wan2.2 recipe
(500 VAE and 3200 trunk steps) trained other weights on a 2-core AMD EPYC with AVX-512 (seen-prompt
accuracy 91.7 % against 93.8 %). Pinned, that machine wrote every file of those weights, trained on
an AVX2-only EPYC, byte for byte. The narrower kernels cost time there (the trunk stage took 898 s
against 766 s). Pinning either alone changed the weights; MKL's GEMMs need no pin (``MKL_CBWR=AVX2``
changed none). A variable already set in the environment wins; the manifest records what ran
(:func:`cpu_kernels`)."""


def build_parser(command: str, description: str, shipped: Path) -> argparse.ArgumentParser:
    """The command line of ``command``, whose default output is ``shipped`` (in the demo package)."""
    parser = argparse.ArgumentParser(prog=command, description=description)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"Output directory (default: the shipped copy, vllm_omni_mxfp4_tiny/trained/{shipped.name} in "
        "the demo package).",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="A few steps of every stage (a smoke run, not the shipped weights).",
    )
    return parser


def summary(manifest: dict[str, Any], out: Path, unit: str, manifest_name: str) -> list[str]:
    """What a person reads at the end of a training run: where, how long, the VAE's reconstruction,
    the final losses and the prompt accuracy the run measured (``unit``: what one output is)."""
    metrics = manifest["metrics"]
    evaluation = metrics["diffusers_fp32_eval"]
    lines = [
        f"trained pipeline: {out}",
        f"time: {manifest['seconds']} s",
        f"VAE reconstruction PSNR: {metrics['vae_psnr_db']} dB; final losses: {metrics['final_loss']}",
        "evaluation: diffusers in FP32, "
        + ", ".join(f"{k} {v}" for k, v in evaluation.items() if not isinstance(v, (dict, list))),
    ]
    for key in ("seen_prompts", "held_out_prompts"):
        record = evaluation[key]
        lines.append(
            f"prompt accuracy, {key.replace('_', ' ')} x seeds {evaluation['seeds']}: "
            f"{record['prompt_accuracy']:.1%} of {record[unit + 's']} {unit}s; {record['per_attribute']}"
        )
    size = sum((out / name).stat().st_size for name in manifest["sha256"])
    lines.append(f"{len(manifest['sha256'])} files, {size / 2**20:.2f} MiB, SHA-256 in {out / manifest_name}")
    return lines


def main(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    *,
    shipped: Path,
    train: Callable[[Path, Any], dict[str, Any]],
    recipes: tuple[Callable[[], Any], Callable[[], Any]],
    unit: str,
    manifest_name: str,
) -> int:
    """Parse ``argv``, train with the default recipe (``--quick``: the quick one) into ``--out`` or
    ``shipped``, print the :func:`summary`; returns the exit status."""
    args = parser.parse_args(argv)
    if args.out is None and args.quick:
        parser.error("--quick would overwrite the shipped weights; give --out")
    out = args.out or shipped
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    pin_cpu_kernels()
    import torch

    torch.set_num_threads(THREADS)
    kernels, pinned = cpu_kernels(), pinned_kernels()
    if pinned and kernels != pinned:
        logger.warning(
            "computing with CPU kernels %s, not the pinned %s (a variable was set otherwise, or torch was "
            "running before the command): the weights will not match the shipped ones bit for bit",
            kernels,
            pinned,
        )
    default, quick = recipes
    manifest = train(out, quick() if args.quick else default())
    for line in summary(manifest, out, unit, manifest_name):
        print(line)
    return 0


def pin_cpu_kernels() -> bool:
    """Set :data:`CPU_KERNELS` in the environment (x86-64; a variable already set wins) and say whether
    it did. Only in a process that has not imported torch yet, as the command line's has not: ATen
    reads its variable at its first vectorized operation and oneDNN at its first primitive, so later
    the pin would not hold, and a caller with torch running (a test calling :func:`main`) keeps its
    environment, which the processes it starts inherit."""
    if "torch" in sys.modules or pinned_kernels() is None:
        return False
    for name, value in CPU_KERNELS.items():
        os.environ.setdefault(name, value)
    return True


def pinned_kernels() -> dict[str, str] | None:
    """:data:`CPU_KERNELS` as :func:`cpu_kernels` reports them; ``None`` off x86-64, where nothing is
    pinned."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return {
        "aten": CPU_KERNELS["ATEN_CPU_CAPABILITY"].upper(),
        "onednn_max_isa": CPU_KERNELS["ONEDNN_MAX_CPU_ISA"],
    }


def cpu_kernels() -> dict[str, str]:
    """The CPU kernels this process computes with, as the manifest records them: ATen's capability
    and oneDNN's ISA limit (``native``: unpinned)."""
    import torch

    return {
        "aten": torch.backends.cpu.get_cpu_capability(),
        "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "native"),
    }


class StageClock:
    """Seconds per training stage, as the manifest records them (``seconds``), and the total."""

    def __init__(self) -> None:
        self.started = self.since = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, name: str) -> None:
        """Record the time since the last lap (or the start) as stage ``name``."""
        now = time.perf_counter()
        self.seconds[name] = round(now - self.since, 1)
        self.since = now

    def skip(self) -> None:
        """Start the next stage now: the time since the last lap counts in the total only."""
        self.since = time.perf_counter()

    def record(self) -> dict[str, float]:
        """Each stage's seconds and the total since the clock was made."""
        return {**self.seconds, "total": round(time.perf_counter() - self.started, 1)}


def recipe_record(recipe: Any) -> dict[str, Any]:
    """A recipe dataclass (stages as nested dataclasses) as the manifest's plain JSON ``recipe``."""
    return {
        k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
        for k, v in dataclasses.asdict(recipe, dict_factory=dict).items()
    }


def final_loss(losses: list[float]) -> float:
    """A stage's final loss: the mean over its last tenth of steps (one step's loss is noise)."""
    window = losses[-max(len(losses) // 10, 1) :]
    return round(sum(window) / len(window), 5)


def accuracy_record(accuracy: Any, unit: str) -> dict[str, Any]:
    """A :class:`.detect.Accuracy` as the manifest records it (``unit``: what one output is)."""
    return {
        f"{unit}s": accuracy.outputs,
        "prompt_accuracy": round(accuracy.value, 4),
        "per_attribute": {k: round(v, 4) for k, v in accuracy.per_attribute.items()},
    }


def library_versions() -> dict[str, str]:
    """The versions of the libraries that computed the weights."""
    import diffusers
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
    }


def write_manifest(out: Path, manifest: dict[str, Any], manifest_name: str) -> dict[str, Any]:
    """Add the SHA-256 of every file of ``out`` to ``manifest`` and write it next to them."""
    manifest["sha256"] = file_hashes(out)
    (out / manifest_name).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_hashes(directory: Path) -> dict[str, str]:
    """SHA-256 of every file under ``directory`` but the manifest, by POSIX relative path."""
    return {
        p.relative_to(directory).as_posix(): _sha256(p)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def verify_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of ``directory``, after checking that its files are exactly those it records,
    byte for byte (SHA-256); a ``ValueError`` names each file that differs, is missing or is extra,
    and the command the manifest records as having written them. Any trained tiny pipeline's
    manifest (:mod:`.trained_wan`'s, :mod:`.trained_flux`'s)."""
    path = directory / MANIFEST
    if not path.is_file():
        raise ValueError(
            f"{directory}: no {MANIFEST}; expected a pipeline written by a training command "
            "(python -m vllm_omni_mxfp4_tiny.trained_wan or .trained_flux)"
        )
    manifest = json.loads(path.read_text())
    recorded, found = manifest.get("sha256", {}), file_hashes(directory)
    problems = [f"{name}: missing" for name in sorted(set(recorded) - set(found))]
    problems += [f"{name}: not in the manifest" for name in sorted(set(found) - set(recorded))]
    problems += [
        f"{name}: SHA-256 {found[name][:12]}... but the manifest records {recorded[name][:12]}..."
        for name in sorted(set(found) & set(recorded))
        if found[name] != recorded[name]
    ]
    if problems:
        command = manifest.get("command", "the training command")
        raise ValueError(
            f"{path}: the files do not match the manifest ({'; '.join(problems)}); rerun "
            f"`{command}` to write them again"
        )
    return manifest
