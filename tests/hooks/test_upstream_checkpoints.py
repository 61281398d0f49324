"""Checkpoints written by vLLM-Omni's own merge script load, and compute what our merge's do.

One real msModelSlim export of the tiny Wan2.2 pipeline (dual-scale; blocks.0 of ``transformer`` and
``blocks.1.ffn.2`` of ``transformer_2`` FLOAT; Smooth on most quantized Linears, not on
``blocks.1.ffn.2`` of ``transformer`` nor ``blocks.0.attn2.to_out`` of ``transformer_2``) is merged
twice: by ``vllm_omni/quantization/tools/merge_mxfp4_dualscale_checkpoint.py`` as installed with
vLLM-Omni 0.30 (run as the user guide runs it) and by ``vllm-omni-mxfp4 merge``.

What differs between the two outputs is pinned here (the user guide lists it): vLLM-Omni's script
lists in ``ignored_layers`` every weight without a ``weight_scale`` (norms, the patch embedding),
writes no ``mul_scale`` for a DualScale layer msModelSlim did not smooth, and keeps msModelSlim's
dtypes (BF16 ``mul_scale``, the original's bias where the layer was not smoothed). Every tensor
holds the same values, and both load (in-process, through vLLM-Omni's factory and loader) and serve
(``Omni(...)``, no quantization argument) to the same outputs, bit for bit.

vLLM-Omni 0.30 ships no single-scale importer (``merge_mxfp4_checkpoint.py`` is not in its wheel),
so only the DualScale script can be run here; the layout that importer writes (numeric FP4, its
``ignored_layers`` with norms and ``patch_embedding``) is built from our numeric merge and loaded.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.platform.omni_procs import Job, omni_installed, run_engine_job, subprocess_env
from tests.support.layers import build_expert, forward, quantized_layers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]

UPSTREAM_TOOL = "vllm_omni.quantization.tools.merge_mxfp4_dualscale_checkpoint"
EXPERTS = ("transformer", "transformer_2")
#: The DualScale Linears msModelSlim did not smooth (diffusers names), per expert.
UNSMOOTHED = {"transformer": "blocks.1.ffn.net.2", "transformer_2": "blocks.0.attn2.to_out.0"}


def _specs():
    from vllm_omni_mxfp4_tiny.msmodelslim_export import NON_BLOCK_EXCLUDES, ExpertSpec, all_linears

    return {
        "transformer": ExpertSpec(
            "dual",
            "mindie",
            exclude=["*blocks.0.*", *NON_BLOCK_EXCLUDES],
            smooth=[g for g in all_linears(1) if g != ["blocks.1.ffn.2"]],
        ),
        "transformer_2": ExpertSpec(
            "dual",
            "mindie",
            exclude=["blocks.1.ffn.2", *NON_BLOCK_EXCLUDES],
            smooth=[
                g
                for b in (0, 1)
                for g in all_linears(b)
                if g not in (["blocks.1.ffn.2"], ["blocks.0.cross_attn.o"])
            ],
        ),
    }


def _single_specs():
    """Single-scale, Smooth on every quantized Linear (vLLM-Omni's single-scale importer takes Smooth
    on all of an expert's quantized Linears or on none)."""
    from vllm_omni_mxfp4_tiny.msmodelslim_export import NON_BLOCK_EXCLUDES, ExpertSpec, all_linears

    return {
        "transformer": ExpertSpec(
            "single", "mindie", exclude=["*blocks.0.*", *NON_BLOCK_EXCLUDES], smooth=all_linears(1)
        ),
        "transformer_2": ExpertSpec(
            "single",
            "mindie",
            exclude=["blocks.1.ffn.2", *NON_BLOCK_EXCLUDES],
            smooth=[g for b in (0, 1) for g in all_linears(b) if g != ["blocks.1.ffn.2"]],
        ),
    }


@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    """(the tiny two-expert original, its DualScale export, its single-scale export), both by
    msModelSlim. Every test here takes this session fixture (through :func:`merged_twice` or
    :func:`single_scale`), so both are built before the module's process group exists
    (msModelSlim's savers write per-rank directories under one)."""
    pytest.importorskip("msmodelslim")
    from vllm_omni_mxfp4_tiny import build_tiny_wan
    from vllm_omni_mxfp4_tiny.msmodelslim_export import export_pipeline

    original, root = build_tiny_wan(2), tmp_path_factory.mktemp("exports")
    export_pipeline(original, root / "dual", _specs())
    export_pipeline(original, root / "single", _single_specs())
    return original, root / "dual", root / "single"


@pytest.fixture(scope="session")
def merged_twice(exports, tmp_path_factory):
    """(upstream's merge, our merge) of the DualScale export."""
    from vllm_omni_mxfp4.checkpoint import merge

    original, quant, _ = exports
    root = tmp_path_factory.mktemp("upstream")
    tool = importlib.util.find_spec(UPSTREAM_TOOL).origin
    args = ["--model-type", "Wan2.2-T2V-A14B", "--original-model", str(original)]
    args += ["--quant-path", str(quant), "--output-path", str(root / "upstream")]
    done = subprocess.run([sys.executable, tool, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    merge("Wan2.2-T2V-A14B", original, quant, root / "ours")
    return root / "upstream", root / "ours"


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _quantization_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("sub", EXPERTS)
def test_the_two_merges_differ_only_as_documented(merged_twice, sub):
    upstream, ours = (_tensors(d / sub) for d in merged_twice)
    unsmoothed = UNSMOOTHED[sub]
    # Ours adds an identity Smooth where msModelSlim did not smooth; upstream's writes none.
    assert set(ours) - set(upstream) == {f"{unsmoothed}.mul_scale"}
    assert torch.equal(ours[f"{unsmoothed}.mul_scale"], torch.ones_like(ours[f"{unsmoothed}.mul_scale"]))
    assert set(upstream) <= set(ours)
    for name, theirs in upstream.items():
        mine = ours[name]
        assert mine.shape == theirs.shape, name
        if mine.dtype != theirs.dtype:  # msModelSlim's BF16 Smooth, or the original's bias: widened by ours
            assert name.endswith((".mul_scale", ".bias")) and mine.dtype == torch.float32, name
            assert torch.equal(mine.double(), theirs.double()), name
        else:
            assert torch.equal(mine, theirs), name
    theirs, mine = (_quantization_config(d / sub) for d in merged_twice)
    assert {k: v for k, v in theirs.items() if k != "ignored_layers"} == {
        k: v for k, v in mine.items() if k != "ignored_layers"
    }
    # Upstream's list is ours plus the weights of modules that are not Linears.
    extra = set(theirs["ignored_layers"]) - set(mine["ignored_layers"])
    assert set(mine["ignored_layers"]) <= set(theirs["ignored_layers"])
    assert {"patch_embedding", "blocks.0.attn1.norm_k", "blocks.1.norm2"} <= extra
    assert all(e == "patch_embedding" or ".norm" in e for e in extra), extra


def test_an_upstream_checkpoint_loads_and_computes_as_ours(vllm_env, merged_twice, caplog):
    upstream, ours = merged_twice
    for sub in EXPERTS:
        with caplog.at_level(logging.INFO, logger="vllm_omni_mxfp4.hooks.names"):
            theirs = build_expert(vllm_env, upstream, None, sub)
        accepted = [
            r.getMessage() for r in caplog.records if "modules that are not Linears" in r.getMessage()
        ]
        caplog.clear()
        assert len(accepted) == 1 and "RMSNorm (blocks.0.attn1.norm_k" in accepted[0], accepted
        assert "1 Conv3dLayer (patch_embedding)" in accepted[0]
        mine = build_expert(vllm_env, ours, None, sub)
        assert set(quantized_layers(theirs)) == set(quantized_layers(mine))
        runtime = UNSMOOTHED[sub].replace(".net.2", ".net_2").replace(".to_out.0", ".to_out")
        assert "mul_scale" not in quantized_layers(theirs)[runtime].state_dict()  # identity Smooth
        assert torch.equal(forward(vllm_env, theirs), forward(vllm_env, mine))


def test_an_explicit_method_loads_it_too(vllm_env, merged_twice):
    """``--quantization mxfp4_dualscale`` with the checkpoint: the list is still the checkpoint's."""
    upstream, ours = merged_twice
    theirs = build_expert(vllm_env, upstream, "mxfp4_dualscale", "transformer_2")
    assert torch.equal(
        forward(vllm_env, theirs), forward(vllm_env, build_expert(vllm_env, ours, None, "transformer_2"))
    )


def _variant(src: Path, dst: Path, config=None, tensors=None, sub="transformer") -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        path = dst / sub / "config.json"
        data = json.loads(path.read_text())
        config(data["quantization_config"])
        path.write_text(json.dumps(data))
    if tensors is not None:
        path = dst / sub / "diffusion_pytorch_model.safetensors"
        data = load_file(str(path))
        tensors(data)
        save_file(data, str(path))
    return dst


def _refused(env, model: Path, spec=None, sub="transformer") -> str:
    with pytest.raises(ValueError) as info:
        build_expert(env, model, spec, sub)
    return str(info.value)


@pytest.mark.parametrize(
    ("entry", "why"),
    [("blocks.0.attn1.norm_kk", "names neither a Linear"), ("blocks.0", "names neither a Linear")],
    ids=["nothing", "a-block-of-linears"],
)
def test_a_checkpoint_entry_that_names_no_module_is_still_refused(
    vllm_env, merged_twice, tmp_path, entry, why
):
    def edit(qc):
        qc["ignored_layers"][qc["ignored_layers"].index("blocks.0.attn1.norm_k")] = entry

    message = _refused(vllm_env, _variant(merged_twice[0], tmp_path / "m", config=edit))
    assert f"ignored_layers entry {entry!r} of the checkpoint's config.json {why}" in message
    assert "re-run vllm-omni-mxfp4 merge" in message


def test_a_users_list_naming_a_norm_is_refused(vllm_env, merged_twice):
    """The same norm name the checkpoint may list is refused in a list the user passes (online here:
    the BF16 original, whose config.json states no list)."""
    from vllm_omni_mxfp4_tiny import build_tiny_wan

    spec = {
        "method": "mxfp4_dualscale",
        "num_bf16_fallback_layers": 0,
        "ignored_layers": ["blocks.0.attn1.norm_k"],
    }
    message = _refused(vllm_env, build_tiny_wan(2), spec)
    assert (
        "ignored_layers entry 'blocks.0.attn1.norm_k' matches no Linear of the WanTransformer3DModel"
        in message
    )


def test_a_lost_mul_scale_that_the_description_lists_is_refused(vllm_env, merged_twice, tmp_path):
    """Identity Smooth is for layers msModelSlim did not smooth; a mul_scale dropped from the weights
    while the merge's description lists it is refused, naming both."""
    lost = "blocks.1.attn2.to_q.mul_scale"
    model = _variant(merged_twice[0], tmp_path / "m", tensors=lambda t: t.pop(lost))
    message = _refused(vllm_env, model)
    assert f"quant_model_description.json: lists tensor {lost!r} (FLOAT), which no weight file" in message


def test_inspect_says_which_rule_applied(merged_twice):
    from vllm_omni_mxfp4.config.names import STORAGE_RULE
    from vllm_omni_mxfp4.inspection import format_table, inspect_path

    report = inspect_path(merged_twice[0], "transformer")
    assert report.ok, report.problems
    (component,) = report.components
    assert component.names_rule == STORAGE_RULE
    assert any("modules that are not Linears: 8 RMSNorm" in note for note in component.notes), component.notes
    assert f"layer names checked as {STORAGE_RULE}" in format_table(report)


def test_both_serve_through_omni_to_the_same_frames(merged_twice, tmp_path):
    frames = []
    for model, out in zip(merged_twice, ("upstream", "ours")):
        trace = tmp_path / f"{out}.jsonl"
        job = Job(str(model), str(tmp_path / out), steps=2, boundary_ratio=0.875)
        run_engine_job(job, timeout=400, env=subprocess_env({"VLLM_OMNI_MXFP4_TRACE_FILE": str(trace)}))
        calls = [json.loads(line) for line in trace.read_text().splitlines()]
        assert {c["method"] for c in calls} == {"mxfp4_dualscale"}
        assert len({(c["pid"], c["layer"]) for c in calls}) == 8 + 15  # transformer: block 1; transformer_2
        frames.append(np.load(tmp_path / out / "frames_0.npy"))
    assert np.isfinite(frames[0]).all()
    assert np.array_equal(frames[0], frames[1])


# ------------------------------------------------- the layout of vLLM-Omni's single-scale importer

#: Runtime names of Wan's Linears whose checkpoint names differ (fused Q/K/V, ``net_0``, ``to_out``).
RUNTIME_RENAMES = (
    (".attn1.to_q", ".attn1.to_qkv"),
    (".attn1.to_k", ".attn1.to_qkv"),
    (".attn1.to_v", ".attn1.to_qkv"),
    (".ffn.net.0.proj", ".ffn.net_0.proj"),
    (".ffn.net.2", ".ffn.net_2"),
    (".to_out.0", ".to_out"),
)


def _runtime(module: str) -> str:
    for old, new in RUNTIME_RENAMES:
        if module.endswith(old):
            return module[: -len(old)] + new
    return module


@pytest.fixture(scope="session")
def single_scale(exports, tmp_path_factory):
    """(our merge, packed; the importer's layout) of the single-scale export.

    vLLM-Omni 0.30's wheel has no single-scale importer (``merge_mxfp4_checkpoint.py`` of its
    development branches), so its output is written here from what that tool is documented to write:
    FP4 values as BF16 ``(N, K)`` with uint8 scales and float32 ``mul_scale`` (our ``numeric``
    layout), and a ``quantization_config`` whose ``ignored_layers`` lists every weight of the
    original without a ``weight_scale``: the BF16 Linears, the norms and ``patch_embedding``."""
    from vllm_omni_mxfp4.checkpoint import merge

    original, _, quant = exports
    root = tmp_path_factory.mktemp("single")
    merge("Wan2.2-T2V-A14B", original, quant, root / "ours")
    merge("Wan2.2-T2V-A14B", original, quant, root / "importer", weight_layout="numeric")
    for sub in EXPERTS:
        tensors = _tensors(root / "importer" / sub)
        scaled = {n.removesuffix(".weight_scale") for n in tensors if n.endswith(".weight_scale")}
        weights = {n.removesuffix(".weight") for n in tensors if n.endswith(".weight")}
        path = root / "importer" / sub / "config.json"
        config = json.loads(path.read_text())
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "is_checkpoint_mxfp4_serialized": True,
            "ignored_layers": sorted({_runtime(m) for m in weights - scaled}),
            "require_smooth_scale": True,
        }
        path.write_text(json.dumps(config, indent=2))
    return root / "ours", root / "importer"


def test_the_single_scale_importers_layout_loads_and_computes_as_ours(vllm_env, single_scale, caplog):
    ours, importer = single_scale
    for sub in EXPERTS:
        listed = _quantization_config(importer / sub)["ignored_layers"]
        assert {"patch_embedding", "blocks.0.attn1.norm_k", "blocks.1.norm2"} <= set(listed)
        with caplog.at_level(logging.INFO, logger="vllm_omni_mxfp4.hooks.names"):
            theirs = build_expert(vllm_env, importer, None, sub)
        accepted = [
            r.getMessage() for r in caplog.records if "modules that are not Linears" in r.getMessage()
        ]
        caplog.clear()
        assert len(accepted) == 1 and "1 Conv3dLayer (patch_embedding)" in accepted[0], accepted
        mine = build_expert(vllm_env, ours, None, sub)
        assert set(quantized_layers(theirs)) == set(quantized_layers(mine))
        assert {type(m.quant_method).__name__ for m in quantized_layers(theirs).values()} == {
            "Mxfp4LinearMethod"
        }
        assert torch.equal(forward(vllm_env, theirs), forward(vllm_env, mine))


def test_inspect_accepts_the_single_scale_importers_layout(single_scale):
    from vllm_omni_mxfp4.config.names import STORAGE_RULE
    from vllm_omni_mxfp4.inspection import inspect_path

    report = inspect_path(single_scale[1])
    assert report.ok, report.problems
    assert [c.names_rule for c in report.components] == [STORAGE_RULE, STORAGE_RULE]
