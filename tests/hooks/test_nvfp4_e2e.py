"""End to end: an NVFP4 pipeline served with ``mxfp4`` by ``Omni(...)`` and ``vllm serve --omni`` on
the CPU platform (subprocess engines, each bounded in its own process group).

The pipeline is the demo's tiny two-expert Wan2.2 with both experts' block Linears packed to NVFP4
by compressed-tensors itself (:func:`tests.support.nvfp4.checkpoints.nvfp4_pipeline`). The served run and its
BF16 reference are the engine runs shared with other files (``tests/support/engine_runs.py``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.platform.omni_procs import (
    Job,
    RunFailed,
    log_tail,
    omni_installed,
    reap_group,
    run_engine_job,
    serve_command,
    subprocess_env,
    wait_until_healthy,
)
from tests.support.engine_runs import nvfp4_served_job, wan_bf16_job
from tests.support.metrics import cosine
from tests.support.nvfp4.checkpoints import nvfp4_pipeline
from tests.support.ports import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]

ENGINE_DEADLINE_S = 500.0
BLOCK_LINEARS = 20  # 2 blocks x (attn1 q/k/v/out, attn2 q/k/v/out, ffn net.0.proj, net.2) per expert


@pytest.fixture(scope="module")
def nvfp4_dir(tiny_dir, tmp_path_factory) -> Path:
    return nvfp4_pipeline(tiny_dir, tmp_path_factory.mktemp("nvfp4") / "wan")


def run(tmp: Path, model: Path, **kwargs) -> tuple[np.ndarray, dict]:
    job = Job(str(model), str(tmp), omni_kwargs=kwargs, steps=2, report=True)
    result = run_engine_job(job, timeout=ENGINE_DEADLINE_S, env=subprocess_env())
    return np.load(tmp / "frames_0.npy"), result


def test_omni_serves_the_nvfp4_pipeline_requantized(tiny_dir, nvfp4_dir, shared_runs):
    served = shared_runs.run(nvfp4_served_job(nvfp4_dir), timeout=ENGINE_DEADLINE_S)
    frames, result = served.frames(0), served.result
    reference = shared_runs.run(wan_bf16_job(tiny_dir), timeout=ENGINE_DEADLINE_S, trace=True).frames(0)
    assert frames.shape == reference.shape and np.isfinite(frames).all()
    assert cosine(frames, reference) > 0.98
    reports = {t["name"]: t for t in result["transformers"]}
    assert sorted(reports) == ["transformer", "transformer_2"]
    for report in reports.values():
        assert {(e["method"], e["mode"]) for e in report["linears"]} == {("mxfp4", "offline")}
        requantized = [r for r in report["nvfp4"] if r["action"] == "requantize"]
        assert len(requantized) == BLOCK_LINEARS
        assert {(r["rule"], r["precision"]) for r in requantized} == {("mse", "w4a4")}
        assert all(0 < r["rel_rms"] < 0.2 for r in requantized)
        embedders = [r for r in report["nvfp4"] if r["layer"].startswith("condition_embedder.")]
        assert embedders and {r["action"] for r in embedders} == {"keep"}
        assert all("excluded by ignore pattern 're:condition_embedder.*'" in r["reason"] for r in embedders)


def test_vllm_serve_starts_on_the_nvfp4_pipeline(nvfp4_dir, tmp_path):
    if importlib.util.find_spec("torchaudio") is None:
        pytest.skip("torchaudio is not installed; vLLM-Omni's API server cannot start without it")
    port, log = free_port(), tmp_path / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, *serve_command(nvfp4_dir, port)[1:], "--quantization", "mxfp4"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=subprocess_env(),
            start_new_session=True,
        )
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", server, log, ENGINE_DEADLINE_S)
    finally:
        leftover = reap_group(server, settle=30.0)
    assert not leftover, f"server processes {leftover} outlived SIGTERM by 30s"
    text = log.read_text()
    assert "transformer: NVFP4 checkpoint by compressed-tensors" in text, log_tail(log)
    assert "20 requantize (rule mse)" in text, log_tail(log)


def test_a_refused_layer_stops_the_engine_naming_it(nvfp4_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    refused = tmp_path / "refused"
    shutil.copytree(nvfp4_dir, refused)
    path = next((refused / "transformer_2").glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors["blocks.1.attn2.to_v.svdquant_lora_a"] = tensors["blocks.1.attn2.to_v.weight_scale"][:4].float()
    save_file(tensors, str(path), {"format": "pt"})
    with pytest.raises(RunFailed):
        run(tmp_path / "out", refused, quantization="mxfp4")
    log = (tmp_path / "out" / "engine.log").read_text()
    assert "blocks.1.attn2.to_v: SVDQuant low-rank branch (svdquant_lora_a)" in log, log[-3000:]
