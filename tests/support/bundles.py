"""The method bundles of the deployment tests (parallelism, cache, LoRA, serving): every method this
package serves, two per engine (one per expert of the tiny two-expert Wan2.2), so that a feature
meets every method in three engines.

- ``online``: ``transformer`` quantized at load with ``mxfp4``, W4A8 on the listed denoise steps and
  on :data:`A8_LAYERS`; ``transformer_2`` with ``mxfp4_dualscale`` at load.
- ``checkpoint``: an offline checkpoint; ``transformer`` stores block 0 as MXFP8 W8A8
  (``mxfp8_layers``) and block 1 as MXFP4 with Smooth factors on its attention and FFN-out Linears;
  ``transformer_2`` is an offline ``mxfp4_dualscale`` expert (Smooth on every Linear). No
  quantization argument: each expert's ``config.json`` says it.
- ``nvfp4``: ``transformer`` is an NVFP4 checkpoint (compressed-tensors' own packing) served with
  ``mxfp4`` (requantized while it loads) and W4A8 on the listed steps; ``transformer_2`` is BF16,
  quantized at load with ``mxfp4_dualscale``.

The suite runs the online bundle; the stored ones (``checkpoint``, ``nvfp4``, :data:`STORED`) run
with ``--all-bundles`` (:func:`require_bundle`): each engine with several ranks costs about a minute
of the suite on two cores, and the stored bundles differ from the online one only in how the weights
load, which the loading tests cover in one process.

DualScale keeps no leading block in BF16 here (``num_bf16_fallback_layers: 0``: the tiny experts
have two blocks, fewer than the default five).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support.layers import write_mxfp8_blocks, write_offline_checkpoint

BUNDLES = ("online", "checkpoint", "nvfp4")
STORED = ("checkpoint", "nvfp4")
A8_LAYERS = ["blocks.0.ffn.net_2"]
METHODS = {
    "online": {"mxfp4", "mxfp4_dualscale"},
    "checkpoint": {"mxfp8", "mxfp4", "mxfp4_dualscale"},
    "nvfp4": {"mxfp4", "mxfp4_dualscale"},
}
DUALSCALE = {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0}
BLOCK_1_SMOOTH = tuple(f"blocks.1.{name}" for name in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "ffn.net.2"))


def _checkpoint_model(tiny: Path, root: Path) -> Path:
    model = root / "checkpoint"
    if not model.exists():
        shutil.copytree(tiny, model, ignore=shutil.ignore_patterns("transformer", "transformer_2"))
        write_mxfp8_blocks(
            tiny / "transformer", model / "transformer", blocks=(0,), smooth_layers=BLOCK_1_SMOOTH
        )
        write_offline_checkpoint(tiny / "transformer_2", model / "transformer_2", "mxfp4_dualscale")
    return model


def _nvfp4_model(tiny: Path, root: Path) -> Path:
    from vllm_omni_mxfp4_tiny.nvfp4_source import cached_nvfp4_pipeline

    model = root / "nvfp4"
    if not model.exists():
        shutil.copytree(cached_nvfp4_pipeline(tiny), model, ignore=shutil.ignore_patterns("transformer_2"))
        shutil.copytree(tiny / "transformer_2", model / "transformer_2")
    return model


def require_bundle(config: pytest.Config, name: str) -> None:
    """Skip the calling test for a stored bundle unless the run asked for them (``--all-bundles``)."""
    if name in STORED and not config.getoption("--all-bundles"):
        pytest.skip(f"the {name} bundle runs with --all-bundles (tests/support/bundles.py)")


def bundle(name: str, tiny: Path, root: Path, a8_steps: list[int]) -> tuple[Path, dict[str, Any]]:
    """Bundle ``name``'s model directory (written under ``root`` once) and its ``Omni`` keyword
    arguments, with W4A8 on ``a8_steps`` where the bundle has W4A8 by step."""
    if name == "online":
        mxfp4 = {"method": "mxfp4", "w4a8_fallback_steps": a8_steps, "w4a8_fallback_layers": A8_LAYERS}
        return tiny, {"quantization_config": {"transformer": mxfp4, "transformer_2": DUALSCALE}}
    if name == "checkpoint":
        return _checkpoint_model(tiny, root), {}
    if name == "nvfp4":
        mxfp4 = {"method": "mxfp4", "w4a8_fallback_steps": a8_steps}
        return _nvfp4_model(tiny, root), {
            "quantization_config": {"transformer": mxfp4, "transformer_2": DUALSCALE}
        }
    raise ValueError(f"unknown bundle {name!r}; the bundles are {BUNDLES}")


def expected_precision(name: str, call: dict[str, Any], a8_steps: list[int]) -> str:
    """The precision bundle ``name``'s route gives a traced call (its method, prefix and step)."""
    if call["method"] == "mxfp8":
        return "w8a8"
    by_step = name != "checkpoint" and call["step"] in a8_steps
    by_layer = name == "online" and call["prefix"] in A8_LAYERS
    return "w4a8" if call["method"] == "mxfp4" and (by_step or by_layer) else "w4a4"
