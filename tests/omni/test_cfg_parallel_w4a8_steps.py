"""W4A8 by step under CFG parallelism on the CPU platform (real gloo groups, two worker processes).

The tiny two-expert Wan2.2 runs one request with true classifier-free guidance and
``w4a8_fallback_steps: [1]``, once in one process and once with ``cfg_parallel_size=2`` (each rank
computes one guidance branch). The trace (``VLLM_OMNI_MXFP4_TRACE_FILE``, one line per quantized
Linear call with the process id) must show that both ranks ran W4A8 on step 1 and on no other
step, and the CFG-parallel output must equal the one-process output bit for bit: the two branches
are the same computations, only placed on different ranks.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from tests.platform.omni_procs import omni_installed, subprocess_env
from vllm_omni_mxfp4_tiny.engine_job import Job
from vllm_omni_mxfp4_tiny.runner import run_engine_job

pytestmark = [
    pytest.mark.slow,
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]

STEPS = 3
A8_STEPS = [1]


@pytest.fixture(scope="module")
def runs(tiny_dir: Path, tmp_path_factory) -> dict[int, tuple[np.ndarray, list[dict]]]:
    """Per CFG-parallel size (1, 2): the frames and the trace of the same request."""
    out = {}
    for size in (1, 2):
        work = tmp_path_factory.mktemp(f"cfg{size}")
        trace = work / "trace.jsonl"
        kwargs: dict = {"quantization_config": {"method": "mxfp4", "w4a8_fallback_steps": A8_STEPS}}
        if size > 1:
            kwargs["cfg_parallel_size"] = size
        job = Job(
            model=str(tiny_dir), out=str(work), omni_kwargs=kwargs, seeds=[3], height=32, width=32,
            num_frames=5, steps=STEPS, guidance_scale=4.0,
        )  # fmt: skip
        run_engine_job(job, timeout=600, env=subprocess_env({"VLLM_OMNI_MXFP4_TRACE_FILE": str(trace)}))
        calls = [json.loads(line) for line in trace.read_text().splitlines()]
        out[size] = (np.load(work / "frames_0.npy"), [c for c in calls if c["step"] is not None])
    return out


def _steps_by_rank(calls: list[dict]) -> dict[int, dict[str, set]]:
    by_pid: dict[int, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for call in calls:
        by_pid[call["pid"]][call["precision"]].add(call["step"])
    return by_pid


def test_every_cfg_rank_runs_w4a8_on_the_listed_steps_only(runs):
    ranks = _steps_by_rank(runs[2][1])
    assert len(ranks) == 2  # two worker processes ran quantized Linears, one guidance branch each
    for steps in ranks.values():
        assert steps == {"w4a8": set(A8_STEPS), "w4a4": set(range(STEPS)) - set(A8_STEPS)}
    (one,) = _steps_by_rank(runs[1][1]).values()
    assert one == {"w4a8": set(A8_STEPS), "w4a4": set(range(STEPS)) - set(A8_STEPS)}


def test_cfg_parallel_output_equals_one_process(runs):
    single, parallel = runs[1][0], runs[2][0]
    assert single.shape == parallel.shape and single.std() > 0
    assert np.array_equal(single, parallel)
