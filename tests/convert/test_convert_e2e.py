"""End to end (slow): a converted NVFP4 pipeline loads through ``Omni(...)`` on the CPU platform with
no quantization argument (the MXFP4 layout is auto-detected), and generates exactly what serving the
NVFP4 pipeline with load-time requantization generates under the same rule.

The NVFP4 pipeline is the demo's tiny two-expert Wan2.2 with its block Linears packed by
compressed-tensors itself (:func:`tests.support.nvfp4.checkpoints.nvfp4_pipeline`); serving it is the run
that tests/hooks/test_nvfp4_e2e.py checks too (shared: ``tests/support/engine_runs.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.platform.omni_procs import Job, omni_installed, run_engine_job, subprocess_env
from tests.support.engine_runs import nvfp4_served_job
from tests.support.nvfp4.checkpoints import nvfp4_pipeline
from vllm_omni_mxfp4.convert import convert

pytestmark = [
    pytest.mark.slow,
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]

ENGINE_DEADLINE_S = 500.0


def run(tmp: Path, model: Path, **kwargs) -> tuple[np.ndarray, dict]:
    job = Job(str(model), str(tmp), omni_kwargs=kwargs, steps=2, report=True)
    result = run_engine_job(job, timeout=ENGINE_DEADLINE_S, env=subprocess_env())
    return np.load(tmp / "frames_0.npy"), result


def test_converted_pipeline_is_auto_detected_and_equals_online_requantization(
    tiny_dir: Path, shared_runs, tmp_path: Path
) -> None:
    source = nvfp4_pipeline(tiny_dir, tmp_path / "nvfp4")
    report = convert(source, tmp_path / "mxfp4", scale_rule="mse", progress=False)
    assert [c.name for c in report.components] == ["transformer", "transformer_2"]
    for sub in ("transformer", "transformer_2"):
        config = json.loads((tmp_path / "mxfp4" / sub / "config.json").read_text())
        assert config["quantization_config"]["quant_method"] == "mxfp4"
    converted, result = run(tmp_path / "converted", tmp_path / "mxfp4")
    online = shared_runs.run(nvfp4_served_job(source), timeout=ENGINE_DEADLINE_S).frames(0)
    assert np.isfinite(converted).all()
    assert np.array_equal(converted, online)
    for transformer in result["transformers"]:
        assert {(e["method"], e["mode"]) for e in transformer["linears"]} == {("mxfp4", "offline")}
