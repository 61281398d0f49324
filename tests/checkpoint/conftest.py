"""Session fixtures: a tiny BF16 Wan2.2 pipeline and real msModelSlim exports of it (built once)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vllm_omni_mxfp4.checkpoint import MergeReport, merge
from vllm_omni_mxfp4_tiny import tiny_transformer_config

from .producer import (
    NON_BLOCK_EXCLUDES,
    ExpertSpec,
    LayerReference,
    all_linears,
    build_pipeline,
    quantize_expert,
)

EXPERTS = {"transformer": "high_noise_model", "transformer_2": "low_noise_model"}

# transformer: blocks.0 and the cross-attention K/V of blocks.2 stay FLOAT; Smooth on some layers.
# transformer_2: blocks.1 stays FLOAT; sharded export; Smooth on other layers.
DUAL_SPECS = {
    "transformer": ExpertSpec(
        "dual",
        "mindie",
        exclude=["*blocks.0.*", "blocks.2.cross_attn.k", "blocks.2.cross_attn.v", *NON_BLOCK_EXCLUDES],
        smooth=[
            ["blocks.1.self_attn.q", "blocks.1.self_attn.k", "blocks.1.self_attn.v"],
            ["blocks.1.cross_attn.k", "blocks.1.cross_attn.v"],
            ["blocks.2.ffn.2"],
        ],
    ),
    "transformer_2": ExpertSpec(
        "dual",
        "mindie",
        exclude=["*blocks.1.*", *NON_BLOCK_EXCLUDES],
        smooth=[
            ["blocks.2.self_attn.q", "blocks.2.self_attn.k", "blocks.2.self_attn.v"],
            ["blocks.0.cross_attn.o"],
        ],
        shard_bytes=600_000,
    ),
}
# transformer: Smooth on every quantized layer (require_smooth_scale true), sharded export.
# transformer_2: Smooth on one layer only (require_smooth_scale false).
SINGLE_SPECS = {
    "transformer": ExpertSpec(
        "single",
        "ascendv1",
        exclude=["*blocks.2.*", *NON_BLOCK_EXCLUDES],
        smooth=all_linears(0) + all_linears(1),
        shard_bytes=700_000,
    ),
    "transformer_2": ExpertSpec(
        "single", "ascendv1", exclude=["*blocks.0.*", *NON_BLOCK_EXCLUDES], smooth=[["blocks.1.ffn.0"]]
    ),
}


@dataclass
class Scenario:
    """A BF16 pipeline, an msModelSlim export of it and what msModelSlim quantized."""

    original: Path
    quant: Path
    states: dict[str, dict[str, torch.Tensor]]
    references: dict[str, dict[str, LayerReference]]
    specs: dict[str, ExpertSpec]


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    """One ``$VLLM_OMNI_MXFP4_CACHE`` for the merges of this session: the runtime names a merge derives
    from a vLLM-Omni class (a child process importing vLLM-Omni, about 10 s) are derived once per
    class and config, then read back, as on a user's machine. It starts empty, so each session
    derives every key it needs once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def private_home(tmp_path_factory, monkeypatch, session_cache):
    """A temporary HOME for each test, so that the merge's staging registry
    (``~/.cache/vllm-omni-mxfp4/merge-staging``) is the test's own, in this process and its children;
    the cache of derived runtime names is the session's (:func:`session_cache`)."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("VLLM_OMNI_MXFP4_CACHE", str(session_cache))
    return home


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    pytest.importorskip("diffusers")
    root = tmp_path_factory.mktemp("orig") / "Wan2.2-T2V-tiny-Diffusers"
    return root, build_pipeline(root)


def _export(tmp_path_factory, pipeline, specs: dict[str, ExpertSpec], name: str) -> Scenario:
    pytest.importorskip("msmodelslim")
    original, states = pipeline
    quant = tmp_path_factory.mktemp(name) / "msmodelslim-output"
    references = {
        folder: quantize_expert(states[folder], quant / EXPERTS[folder], spec, seed=i)
        for i, (folder, spec) in enumerate(specs.items())
    }
    return Scenario(original, quant, states, references, specs)


@pytest.fixture(scope="session")
def dual_export(tmp_path_factory, tiny_pipeline) -> Scenario:
    return _export(tmp_path_factory, tiny_pipeline, DUAL_SPECS, "dual")


@pytest.fixture(scope="session")
def single_export(tmp_path_factory, tiny_pipeline) -> Scenario:
    return _export(tmp_path_factory, tiny_pipeline, SINGLE_SPECS, "single")


@pytest.fixture(scope="session")
def merged_dual(tmp_path_factory, dual_export) -> tuple[Path, MergeReport]:
    out = tmp_path_factory.mktemp("merged") / "dual"
    report = merge("Wan2.2-T2V-A14B", dual_export.original, dual_export.quant, out)
    return out, report


@pytest.fixture(scope="session")
def merged_single_numeric(tmp_path_factory, single_export) -> tuple[Path, MergeReport]:
    out = tmp_path_factory.mktemp("merged") / "single-numeric"
    report = merge(
        "auto",
        single_export.original,
        single_export.quant,
        out,
        weight_layout="numeric",
        max_shard_size=2_000_000,
    )
    return out, report


def writable_copy(tmp_path: Path, scenario: Scenario) -> tuple[Path, Path]:
    """A copy of ``scenario``'s original pipeline and msModelSlim export under ``tmp_path``."""
    original, quant = tmp_path / "orig", tmp_path / "quant"
    shutil.copytree(scenario.original, original)
    shutil.copytree(scenario.quant, quant)
    return original, quant


@pytest.fixture
def expert_copy(tmp_path, dual_export):
    """A writable copy of the dual-scale pipeline + export, for fault injection."""
    return writable_copy(tmp_path, dual_export)


# msModelSlim's shipped Wan2.2 recipes (issue #15) -------------------------------------------------

#: Six blocks: the recipes put blocks 0-4 in W8A8 MXFP8 and the others in W4A4 MXFP4; small widths
#: keep msModelSlim's ceil_x weight search quick.
RECIPE_TINY = tiny_transformer_config(num_layers=6, num_attention_heads=2, attention_head_dim=64, ffn_dim=256)


@dataclass
class RecipeScenario:
    """A BF16 pipeline, msModelSlim's export of it with one shipped recipe, and msModelSlim's own
    quantized Linears (its in-memory fake-quant modules) by transformer folder and original name."""

    recipe: str
    original: Path
    quant: Path
    states: dict[str, dict[str, torch.Tensor]]
    linears: dict[str, dict[str, torch.nn.Module]]


@pytest.fixture(scope="session")
def recipe_pipeline(tmp_path_factory) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    pytest.importorskip("diffusers")
    root = tmp_path_factory.mktemp("recipe-orig") / "Wan2.2-T2V-6-block-Diffusers"
    return root, build_pipeline(root, config=RECIPE_TINY)


def _recipe(recipe: str, pipeline) -> RecipeScenario:
    pytest.importorskip("msmodelslim")
    from vllm_omni_mxfp4_tiny.msmodelslim_recipes import cached_recipe_export

    original, states = pipeline
    quant, linears = cached_recipe_export(recipe, original)
    return RecipeScenario(recipe, original, quant, states, linears)


@pytest.fixture(scope="session")
def w4a4f4_export(recipe_pipeline) -> RecipeScenario:
    return _recipe("w4a4f4", recipe_pipeline)


@pytest.fixture(scope="session")
def w4a4f8_export(recipe_pipeline) -> RecipeScenario:
    return _recipe("w4a4f8", recipe_pipeline)


@pytest.fixture(scope="session")
def merged_recipes(tmp_path_factory, w4a4f4_export, w4a4f8_export) -> dict[str, tuple[Path, MergeReport]]:
    """Each recipe merged with ``--mxfp8-layers keep``, and w4a4f4 with ``bf16``."""
    out = tmp_path_factory.mktemp("merged-recipes")
    merged = {}
    for name, scenario, policy in (
        ("w4a4f4", w4a4f4_export, "keep"),
        ("w4a4f8", w4a4f8_export, "keep"),
        ("w4a4f4-bf16", w4a4f4_export, "bf16"),
    ):
        report = merge("auto", scenario.original, scenario.quant, out / name, mxfp8_layers=policy)
        merged[name] = out / name, report
    return merged


# msModelSlim's svd_res processor (issue #26) -------------------------------------------------------

#: svd_res before the quantizer: transformer single-scale rank 16, transformer_2 DualScale rank 8. Each
#: covers a fused Q/K/V, Linears of both TP kinds and plain-quantized and smoothed Linears beside them;
#: blocks 0 (transformer) and 2 (transformer_2) stay FLOAT.
SVD_SPECS = {
    "transformer": ExpertSpec(
        "single",
        "ascendv1",
        exclude=["*blocks.0.*", *NON_BLOCK_EXCLUDES],
        smooth=[["blocks.2.cross_attn.q"]],
        svd=["blocks.1.*", "blocks.2.self_attn.*", "blocks.2.ffn.*"],
        svd_rank=16,
    ),
    "transformer_2": ExpertSpec(
        "dual",
        "ascendv1",
        exclude=["*blocks.2.*", *NON_BLOCK_EXCLUDES],
        smooth=[["blocks.1.ffn.0"]],
        svd=["blocks.0.*", "blocks.1.self_attn.*", "blocks.1.cross_attn.*", "blocks.1.ffn.2"],
        svd_rank=8,
    ),
}


@pytest.fixture(scope="session")
def svd_export(tmp_path_factory, tiny_pipeline) -> Scenario:
    return _export(tmp_path_factory, tiny_pipeline, SVD_SPECS, "svd")


@pytest.fixture(scope="session")
def merged_svd(tmp_path_factory, svd_export) -> tuple[Path, MergeReport]:
    out = tmp_path_factory.mktemp("merged") / "svd"
    return out, merge("Wan2.2-T2V-A14B", svd_export.original, svd_export.quant, out)


@pytest.fixture
def svd_copy(tmp_path, svd_export):
    """A writable copy of the svd_res pipeline + export, for fault injection."""
    return writable_copy(tmp_path, svd_export)
