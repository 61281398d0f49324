"""W4A8 by step under CFG and sequence (Ulysses) parallelism on the CPU platform (real gloo groups,
two worker processes).

The tiny two-expert Wan2.2 runs one request with true classifier-free guidance and
``w4a8_fallback_steps: [1]``: in one process, with ``cfg_parallel_size=2`` (each rank computes one
guidance branch), with ``ulysses_degree=2`` (each rank holds half the tokens; attention exchanges
heads) and with both (the MXFP4 guide's four-rank example, on a two-core machine with
``VLLM_OMNI_MXFP4_CPU_DEVICES=4``). The trace (``VLLM_OMNI_MXFP4_TRACE_FILE``, one line per quantized Linear call with
the process id) must show that every rank ran W4A8 on step 1 and on no other step, and each
parallel output must equal the one-process output bit for bit (measured: it does; the ranks run
the same Linear computations on their rows). Ring attention (``ring_degree``) does not start on the
CPU platform: vLLM-Omni's ring kernel calls ``aten::_scaled_dot_product_efficient_attention``,
which PyTorch provides for CUDA only.
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


PARALLEL = {
    "one": {},
    "cfg2": {"cfg_parallel_size": 2},
    "ulysses2": {"ulysses_degree": 2},
    "ulysses2-cfg2": {"ulysses_degree": 2, "cfg_parallel_size": 2},  # the MXFP4 guide's four-rank example
}
RANKS = {"cfg2": 2, "ulysses2": 2, "ulysses2-cfg2": 4}


@pytest.fixture(scope="module")
def runs(tiny_dir: Path, tmp_path_factory) -> dict[str, tuple[np.ndarray, list[dict]]]:
    """Per parallel layout of :data:`PARALLEL`: the frames and the trace of the same request."""
    out = {}
    for name, parallel in PARALLEL.items():
        work = tmp_path_factory.mktemp(name)
        trace = work / "trace.jsonl"
        kwargs: dict = {
            "quantization_config": {"method": "mxfp4", "w4a8_fallback_steps": A8_STEPS},
            **parallel,
        }
        job = Job(
            model=str(tiny_dir), out=str(work), omni_kwargs=kwargs, seeds=[3], height=32, width=32,
            num_frames=5, steps=STEPS, guidance_scale=4.0,
        )  # fmt: skip
        # four ranks on a two-core machine: the CPU platform reports as many devices as it is told
        devices = str(max(2, RANKS.get(name, 1)))
        env = subprocess_env(
            {"VLLM_OMNI_MXFP4_TRACE_FILE": str(trace), "VLLM_OMNI_MXFP4_CPU_DEVICES": devices}
        )
        run_engine_job(job, timeout=600, env=env)
        calls = [json.loads(line) for line in trace.read_text().splitlines()]
        out[name] = (np.load(work / "frames_0.npy"), [c for c in calls if c["step"] is not None])
    return out


def _steps_by_rank(calls: list[dict]) -> dict[int, dict[str, set]]:
    by_pid: dict[int, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for call in calls:
        by_pid[call["pid"]][call["precision"]].add(call["step"])
    return by_pid


EXPECTED = {"w4a8": set(A8_STEPS), "w4a4": set(range(STEPS)) - set(A8_STEPS)}


@pytest.mark.parametrize("layout", list(RANKS))
def test_every_rank_runs_w4a8_on_the_listed_steps_only(runs, layout):
    ranks = _steps_by_rank(runs[layout][1])
    assert len(ranks) == RANKS[layout]  # every worker process ran quantized Linears
    assert all(steps == EXPECTED for steps in ranks.values())
    (one,) = _steps_by_rank(runs["one"][1]).values()
    assert one == EXPECTED


@pytest.mark.parametrize("layout", list(RANKS))
def test_parallel_output_equals_one_process(runs, layout):
    single, parallel = runs["one"][0], runs[layout][0]
    assert single.shape == parallel.shape and single.std() > 0
    assert np.array_equal(single, parallel)
