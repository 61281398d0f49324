"""Load-time requantization beyond Wan2.2: any other pipeline's NVFP4 ``transformer`` is built under a
plan whose layer names come from vLLM-Omni's class itself (``nvfp4_loading._class_names``).

End to end: the demo's tiny FLUX.1-dev pipeline with every 2-D weight of its transformer packed by
compressed-tensors, served by ``Omni(..., quantization="mxfp4")`` on the CPU platform (a subprocess
engine). Below it: what the plan refuses before anything is built.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.platform.omni_procs import Job, omni_installed, run_engine_job, subprocess_env
from tests.support import flux1_export
from tests.support.metrics import cosine
from tests.support.nvfp4.checkpoints import pack_component
from vllm_omni_mxfp4.checkpoint import CheckpointError
from vllm_omni_mxfp4.hooks.nvfp4_loading import plan_nvfp4_expert
from vllm_omni_mxfp4.omni import build_quant_config

pytestmark = pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed")

ENGINE_DEADLINE_S = 500.0


@pytest.fixture(scope="module")
def bf16_flux() -> Path:
    from vllm_omni_mxfp4_tiny.flux import build_tiny_flux

    return build_tiny_flux()


@pytest.fixture(scope="module")
def nvfp4_flux(bf16_flux: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("flux1") / "nvfp4"
    shutil.copytree(bf16_flux, root)
    return root, pack_component(root / "transformer")


def run(tmp: Path, model: Path, **kwargs) -> tuple[np.ndarray, dict]:
    job = Job(str(model), str(tmp), omni_kwargs=kwargs, height=64, width=64, num_frames=1, steps=2,
              guidance_scale=3.5, report=True)  # fmt: skip
    result = run_engine_job(job, timeout=ENGINE_DEADLINE_S, env=subprocess_env())
    return np.load(tmp / "frames_0.npy"), result


@pytest.mark.slow
@pytest.mark.omni
def test_omni_serves_a_flux1_nvfp4_pipeline_requantized(bf16_flux, nvfp4_flux, tmp_path) -> None:
    source, packed = nvfp4_flux
    frames, result = run(tmp_path / "nvfp4", source, quantization="mxfp4")
    reference, _ = run(tmp_path / "bf16", bf16_flux)
    assert frames.shape == reference.shape and np.isfinite(frames).all()
    assert cosine(frames, reference) > 0.98
    [report] = result["transformers"]
    records = {r["layer"]: r for r in report["nvfp4"]}
    # what vLLM-Omni's FluxTransformer2DModel quantizes (flux1_export.INCLUDE, read from its code)
    mx = {name for name in packed if any(fnmatch.fnmatch(name, p) for p in flux1_export.INCLUDE)}
    assert {n for n, r in records.items() if r["action"] == "requantize"} == mx and len(mx) == 5
    assert {n for n, r in records.items() if r["action"] == "dequantize"} == set(packed) - mx
    assert {(records[n]["rule"], records[n]["precision"]) for n in mx} == {("mse", "w4a4")}
    assert all(0 < records[n]["rel_rms"] < 0.2 for n in mx)
    assert (
        records["single_transformer_blocks.0.attn.to_q"]["runtime"]
        == "single_transformer_blocks.0.attn.to_qkv"
    )
    quantized = [e for e in report["linears"] if e["method"] != "bf16"]
    assert sorted(e["layer"] for e in quantized) == sorted({records[n]["runtime"] for n in mx})
    assert {(e["method"], e["mode"], e["precision"]) for e in quantized} == {("mxfp4", "offline", "w4a4")}


def od_config(model: Path, pipeline: str = "FluxPipeline") -> SimpleNamespace:
    return SimpleNamespace(
        model=str(model),
        model_class_name=pipeline,
        quantization_config=build_quant_config({"method": "mxfp4"}),
        quantization_config_is_auto_detected=False,
    )


def test_the_plan_takes_the_names_of_the_pipelines_class(nvfp4_flux) -> None:
    plan = plan_nvfp4_expert(od_config(nvfp4_flux[0]), "transformer", derived=True)
    assert plan.runtime["single_transformer_blocks.0.attn.to_v"] == "single_transformer_blocks.0.attn.to_qkv"
    assert plan.modules["single_transformer_blocks.0.attn.to_v"] == "single_transformer_blocks.0.attn.to_qkv"
    assert plan.runtime["transformer_blocks.0.ff.net.0.proj"] == "transformer_blocks.0.ff.net.0.proj"
    assert plan.by_runtime["single_transformer_blocks.0.attn.to_qkv"] == tuple(
        f"single_transformer_blocks.0.attn.to_{p}" for p in "kqv"
    )


def test_a_tensor_the_class_does_not_load_is_refused_before_the_build(nvfp4_flux, tmp_path) -> None:
    root = tmp_path / "model"
    shutil.copytree(nvfp4_flux[0] / "transformer", root / "transformer")
    [path] = sorted((root / "transformer").glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors["single_transformer_blocks.0.attn.to_z.bias"] = torch.zeros(4, dtype=torch.bfloat16)
    save_file(tensors, str(path), {"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        plan_nvfp4_expert(od_config(root), "transformer", derived=True)
    assert "single_transformer_blocks.0.attn.to_z.bias" in str(info.value)
    assert "FluxTransformer2DModel" in str(info.value)


def test_a_config_naming_another_class_is_refused(nvfp4_flux, tmp_path) -> None:
    root = tmp_path / "model"
    shutil.copytree(nvfp4_flux[0] / "transformer", root / "transformer")
    config = json.loads((root / "transformer" / "config.json").read_text())
    config["_class_name"] = "QwenImageTransformer2DModel"
    (root / "transformer" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as info:
        plan_nvfp4_expert(od_config(root, "QwenImagePipeline"), "transformer", derived=True)
    message = str(info.value)
    assert message.startswith(f"{root / 'transformer'}: original tensor ")
    assert "is not loaded by vLLM-Omni's QwenImageTransformer2DModel" in message
