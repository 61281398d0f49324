"""End to end through ``Omni(...)``: names that match nothing in the built model stop the engine with
the message naming them, and the all-string per-component form generates.

Each engine runs under a deadline in its own process group (the demo's engine job and runner).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.platform.omni_procs import Job, RunFailed, omni_installed, run_engine_job, subprocess_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]


def _job(model: Path, out: Path, config: dict) -> Job:
    return Job(
        str(model), str(out), omni_kwargs={"quantization_config": config}, steps=2, boundary_ratio=0.875
    )


def test_all_method_name_components_generate(tiny_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    config = {"transformer": "mxfp4", "transformer_2": "mxfp4"}
    run_engine_job(
        _job(tiny_dir, tmp_path, config),
        timeout=400,
        env=subprocess_env({"VLLM_OMNI_MXFP4_TRACE_FILE": str(trace)}),
    )
    assert np.isfinite(np.load(tmp_path / "frames_0.npy")).all()
    calls = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {c["method"] for c in calls} == {"mxfp4"}
    assert len({(c["pid"], c["layer"]) for c in calls}) == 32  # both experts' 16 Linears


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"transformer": "mxfp4", "transformer2": {"method": "mxfp4"}},
            "Unknown component 'transformer2' in the per-component config. Did you mean 'transformer_2'?",
        ),
        (
            {"method": "mxfp4", "ignored_layers": ["blocks.0.attn2.to_v", "blocks.2.attn2.to_v"]},
            "ignored_layers entry 'blocks.2.attn2.to_v' matches no Linear",
        ),
        (
            {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 40},
            "num_bf16_fallback_layers=40 is larger than the 2 blocks",
        ),
    ],
    ids=["component-typo", "layer-typo", "leading-blocks"],
)
def test_names_that_match_nothing_stop_the_engine(tiny_dir, tmp_path, config, message):
    with pytest.raises(RunFailed) as info:
        run_engine_job(_job(tiny_dir, tmp_path, config), timeout=400, env=subprocess_env())
    assert info.value.reason.startswith("exited with"), info.value
    assert message in (tmp_path / "engine.log").read_text()


def test_an_expert_the_pipeline_does_not_have_stops_the_engine(tmp_path):
    """The A14B per-expert config copied to a single-expert model (TI2V-5B-like): transformer_2 names
    nothing there, and would silently configure nothing; the engine stops naming it."""
    from vllm_omni_mxfp4_tiny import build_tiny_wan

    model = build_tiny_wan(1)
    config = {"transformer": "mxfp4", "transformer_2": "mxfp4"}
    job = Job(str(model), str(tmp_path), omni_kwargs={"quantization_config": config}, steps=2)
    with pytest.raises(RunFailed):
        run_engine_job(job, timeout=400, env=subprocess_env())
    log = (tmp_path / "engine.log").read_text()
    assert "Unknown component 'transformer_2' in the per-component config" in log
    assert "has transformer only" in log
