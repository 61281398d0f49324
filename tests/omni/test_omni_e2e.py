"""End to end: ``Omni(...)`` generates with our methods on the CPU platform (subprocess engines).

Every engine runs under a deadline in its own process group (the demo's engine job and runner),
with ``VLLM_OMNI_MXFP4_TRACE_FILE`` recording each quantized Linear call in every engine process.
The BF16 reference is the run the engine tests share (``tests/support/engine_runs.py``).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.platform.omni_procs import Job, omni_installed, run_engine_job, subprocess_env
from tests.support.engine_runs import wan_bf16_job
from vllm_omni_mxfp4.formats import quantize_dualscale, quantize_mx

pytestmark = [
    pytest.mark.slow,
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]

STEPS = 3
LAYERS_PER_EXPERT = 16


def run_omni(tmp: Path, model: Path, steps: int = STEPS, **kwargs) -> tuple[np.ndarray, list[dict]]:
    trace = tmp / "trace.jsonl"
    job = Job(str(model), str(tmp), omni_kwargs=kwargs, steps=steps, boundary_ratio=0.875)
    run_engine_job(job, timeout=400, env=subprocess_env({"VLLM_OMNI_MXFP4_TRACE_FILE": str(trace)}))
    calls = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
    return np.load(tmp / "frames_0.npy"), calls


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


@pytest.fixture(scope="module")
def bf16_frames(tiny_dir, shared_runs):
    run = shared_runs.run(wan_bf16_job(tiny_dir), timeout=400, trace=True)
    assert run.trace() == []  # nothing quantized
    return run.frames(0)


def _denoise_calls(calls):
    return [c for c in calls if c["step"] is not None]


def test_omni_quantization_name(tiny_dir, bf16_frames, tmp_path):
    # the reference's request (its steps): the two engines differ only in the quantization
    frames, calls = run_omni(tmp_path, tiny_dir, steps=wan_bf16_job(tiny_dir).steps, quantization="mxfp4")
    assert frames.shape == bf16_frames.shape == (1, 9, 16, 16, 3)
    assert np.isfinite(frames).all()
    assert psnr(frames, bf16_frames) > 20
    layers = {c["layer"] for c in calls}
    assert len(layers) == 2 * LAYERS_PER_EXPERT  # both experts quantized
    assert {c["method"] for c in calls} == {"mxfp4"} and {c["precision"] for c in calls} == {"w4a4"}
    assert {c["backend"] for c in calls} == {"emulated"}


def test_omni_step_fallback_switches_exactly_on_listed_steps(tiny_dir, tmp_path):
    config = {"method": "mxfp4", "w4a8_fallback_steps": [0, 2], "mxfp4_scale_alg": 2}
    frames, calls = run_omni(tmp_path, tiny_dir, quantization_config=config)
    assert np.isfinite(frames).all()
    denoise = _denoise_calls(calls)
    # Every call of a step ran at that step's precision, warm-up included.
    for c in denoise:
        assert c["precision"] == ("w4a8" if c["step"] in (0, 2) else "w4a4"), c
    # The request (after the engine's warm-up): classifier-free guidance runs two transformer passes
    # of 16 quantized Linears at each of the 3 steps.
    request = denoise[-STEPS * 2 * LAYERS_PER_EXPERT :]
    assert Counter((c["step"], c["precision"]) for c in request) == {
        (0, "w4a8"): 32,
        (1, "w4a4"): 32,
        (2, "w4a8"): 32,
    }


def test_omni_per_expert_dicts(tiny_dir, tmp_path):
    config = {
        "transformer": {"method": "mxfp4", "w4a8_fallback_layers": ["blocks.0.ffn.net_2"]},
        "transformer_2": {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 1},
    }
    frames, calls = run_omni(tmp_path, tiny_dir, quantization_config=config)
    assert np.isfinite(frames).all()
    by_method = {m: {c["prefix"] for c in calls if c["method"] == m} for m in ("mxfp4", "mxfp4_dualscale")}
    assert len(by_method["mxfp4"]) == LAYERS_PER_EXPERT
    assert all(p.startswith("blocks.1.") for p in by_method["mxfp4_dualscale"])  # block 0 kept BF16
    a8 = {c["prefix"] for c in calls if c["precision"] == "w4a8"}
    assert a8 == {"blocks.0.ffn.net_2"}


def _offline_expert(src: Path, dst: Path, method: str, ignored: str) -> None:
    """Write an offline checkpoint of one expert with the formats core; ``ignored`` stays BF16."""
    shutil.copytree(src, dst)
    path = dst / "diffusion_pytorch_model.safetensors"
    tensors, out = load_file(str(path)), {}
    bf16_prefixes = (
        {ignored.replace("to_qkv", f"to_{x}") for x in "qkv"} if "to_qkv" in ignored else {ignored}
    )
    for name, t in tensors.items():
        prefix = name[: -len(".weight")]
        runtime = prefix.replace("ffn.net.2", "ffn.net_2").replace("ffn.net.0.proj", "ffn.net_0.proj")
        if (
            not (name.endswith(".weight") and name.startswith("blocks.") and t.dim() == 2)
            or runtime in bf16_prefixes
        ):
            out[name] = t
            continue
        if method == "mxfp4":
            out[prefix + ".weight"], out[prefix + ".weight_scale"] = quantize_mx(t)
        else:
            data, scale, dual = quantize_dualscale(t)
            out.update(
                {
                    prefix + ".weight": data,
                    prefix + ".weight_scale": scale,
                    prefix + ".weight_dual_scale": dual.unsqueeze(-1),
                    prefix + ".mul_scale": torch.ones(t.shape[1]),
                }
            )
    save_file(out, str(path))
    config = json.loads((dst / "config.json").read_text())
    flag = "is_checkpoint_mxfp4_serialized" if method == "mxfp4" else "is_checkpoint_serialized"
    config["quantization_config"] = {"quant_method": method, flag: True, "ignored_layers": [ignored]}
    (dst / "config.json").write_text(json.dumps(config))


def test_offline_checkpoint_needs_no_quantization_argument(tiny_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model, ignore=shutil.ignore_patterns("transformer", "transformer_2"))
    _offline_expert(tiny_dir / "transformer", model / "transformer", "mxfp4", "blocks.0.attn1.to_qkv")
    _offline_expert(
        tiny_dir / "transformer_2", model / "transformer_2", "mxfp4_dualscale", "blocks.1.ffn.net_2"
    )
    frames, calls = run_omni(tmp_path / "run", model)
    assert np.isfinite(frames).all()
    prefixes = {m: {c["prefix"] for c in calls if c["method"] == m} for m in ("mxfp4", "mxfp4_dualscale")}
    # Each expert read its own config.json: its own method and its own BF16 layer.
    assert (
        len(prefixes["mxfp4"]) == LAYERS_PER_EXPERT - 1 and "blocks.0.attn1.to_qkv" not in prefixes["mxfp4"]
    )
    assert len(prefixes["mxfp4_dualscale"]) == LAYERS_PER_EXPERT - 1
    assert "blocks.1.ffn.net_2" not in prefixes["mxfp4_dualscale"]
