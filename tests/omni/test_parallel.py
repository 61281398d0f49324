"""Every method under vLLM-Omni's parallel layouts on the CPU platform (real gloo groups, one worker
process per rank), against the same request in one process.

The tiny two-expert Wan2.2 runs one request with true classifier-free guidance, with each of the
three method bundles of :mod:`tests.support.bundles` (two methods per engine, one per expert: every
method this package serves, in three engines per layout), W4A8 by step on :data:`A8_STEPS`.

Layouts (:data:`LAYOUTS`): CFG-parallel 2, Ulysses 2, Ring 2 and TP 2 one at a time, the MXFP4
guide's four-rank ``tp1 x ulysses2 x cfg2`` and ``tp2 x cfg2``. The online bundle runs every
layout; the other two run Ring 2 and the two four-rank layouts, whose factors are the other three
(:data:`BUNDLE_LAYOUTS`). On a two-core
machine four ranks need ``VLLM_OMNI_MXFP4_CPU_DEVICES=4``; without it vLLM-Omni stops, and the
CPU platform's error says so (:func:`test_four_ranks_on_two_cores_name_the_variable`).

What must hold, per bundle and layout:

- The trace (``VLLM_OMNI_MXFP4_TRACE_FILE``, one line per quantized Linear call with the process
  id) shows one process per rank, each running every method of the bundle, every call at the
  precision its route gives at its step, and W4A8 by step on exactly :data:`A8_STEPS` on every rank
  (every CFG branch and every sequence-parallel rank picks the same steps).
- With CFG and Ulysses parallelism alone the output equals the one-process output bit for bit: each
  rank runs the same computations on its rows (CFG: one guidance branch; Ulysses: a share of the
  tokens, with every head's attention computed whole after the all-to-all).
- TP and Ring change the order of the arithmetic, so the output differs by rounding only, bounded by
  :data:`MIN_PSNR_DB`: TP's row-parallel Linears sum two partial products and all-reduce them instead
  of one GEMM's sum; Ring computes attention one key/value chunk at a time and merges the partial
  results through their log-sum-exp in FP32 instead of one softmax. Measured on this random-weight
  model: TP 2 53.2 dB, Ring 2 52.4 dB. The quantized weights themselves are exact: each TP shard
  equals the shard of the one-process weights (``tests/omni/test_wan_tp2.py``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from tests.platform.omni_procs import ENGINE_MARKS, RunFailed, subprocess_env
from tests.support.bundles import A8_LAYERS, BUNDLES, METHODS, bundle, expected_precision
from vllm_omni_mxfp4.compare.metrics import psnr
from vllm_omni_mxfp4_tiny.engine_job import Job
from vllm_omni_mxfp4_tiny.runner import run_engine_job

pytestmark = ENGINE_MARKS

STEPS = 3
A8_STEPS = [0]  # step 0 always runs the high-noise expert, transformer
MIN_PSNR_DB = 40.0  # rounding only: measured 52-53 dB; a wrong shard or chunk merge gives noise (< 20 dB)
REORDERED = ("tp2", "ring2")  # layouts that change the order of the arithmetic (module docstring)

LAYOUTS = {
    "one": {},
    "cfg2": {"cfg_parallel_size": 2},
    "ulysses2": {"ulysses_degree": 2},
    "ring2": {"ring_degree": 2},
    "tp2": {"tensor_parallel_size": 2},
    "ulysses2-cfg2": {"ulysses_degree": 2, "cfg_parallel_size": 2},  # the MXFP4 guide's example
    "tp2-cfg2": {"tensor_parallel_size": 2, "cfg_parallel_size": 2},
}
RANKS = {name: int(np.prod(list(kw.values()))) if kw else 1 for name, kw in LAYOUTS.items()}
BUNDLE_LAYOUTS = {
    "online": list(LAYOUTS),
    "checkpoint": ["one", "ring2", "ulysses2-cfg2", "tp2-cfg2"],
    "nvfp4": ["one", "ring2", "ulysses2-cfg2", "tp2-cfg2"],
}
assert set(BUNDLE_LAYOUTS) == set(BUNDLES)
CASES = [(b, layout) for b, layouts in BUNDLE_LAYOUTS.items() for layout in layouts if layout != "one"]


def _job(model: Path, out: Path, kwargs: dict) -> Job:
    return Job(
        model=str(model), out=str(out), omni_kwargs=kwargs, seeds=[3], height=32, width=32, num_frames=5,
        steps=STEPS, guidance_scale=4.0,
    )  # fmt: skip


def _devices(ranks: int) -> dict[str, str]:
    # four ranks on a two-core machine: the CPU platform reports as many devices as it is told
    return {"VLLM_OMNI_MXFP4_CPU_DEVICES": str(max(2, ranks))}


@pytest.fixture(scope="module")
def runs(tiny_dir: Path, tmp_path_factory) -> dict[tuple[str, str], tuple[np.ndarray, list[dict]]]:
    """Per (bundle, layout): the frames and the denoising calls of the trace of the same request."""
    root = tmp_path_factory.mktemp("parallel")
    out = {}
    for name, layouts in BUNDLE_LAYOUTS.items():
        model, kwargs = bundle(name, tiny_dir, root, A8_STEPS)
        for layout in layouts:
            work = root / f"{name}-{layout}"
            work.mkdir()
            trace = work / "trace.jsonl"
            env = {"VLLM_OMNI_MXFP4_TRACE_FILE": str(trace), **_devices(RANKS[layout])}
            run_engine_job(
                _job(model, work, {**kwargs, **LAYOUTS[layout]}), timeout=600, env=subprocess_env(env)
            )
            calls = [json.loads(line) for line in trace.read_text().splitlines()]
            out[name, layout] = (np.load(work / "frames_0.npy"), [c for c in calls if c["step"] is not None])
    return out


def _by_rank(calls: list[dict]) -> dict[int, list[dict]]:
    ranks: dict[int, list[dict]] = defaultdict(list)
    for call in calls:
        ranks[call["pid"]].append(call)
    return ranks


@pytest.mark.parametrize(("bundle", "layout"), [(b, "one") for b in BUNDLE_LAYOUTS] + CASES)
def test_every_rank_runs_every_method_at_its_precision(runs, bundle, layout):
    ranks = _by_rank(runs[bundle, layout][1])
    assert len(ranks) == RANKS[layout]  # one process per rank, each ran quantized Linears
    for calls in ranks.values():
        assert {c["method"] for c in calls} == METHODS[bundle]
        assert [c for c in calls if c["precision"] != expected_precision(bundle, c, A8_STEPS)] == []
        by_step = {c["step"] for c in calls if c["precision"] == "w4a8" and c["prefix"] not in A8_LAYERS}
        assert by_step == (set() if bundle == "checkpoint" else set(A8_STEPS))
        assert {c["step"] for c in calls} == set(range(STEPS))


@pytest.mark.parametrize(("bundle", "layout"), CASES)
def test_parallel_output_equals_one_process(runs, bundle, layout):
    single, parallel = runs[bundle, "one"][0], runs[bundle, layout][0]
    assert single.shape == parallel.shape and single.std() > 0
    if any(factor in layout for factor in REORDERED):  # rounding order (module docstring)
        assert psnr(parallel, single) >= MIN_PSNR_DB
    else:
        assert np.array_equal(single, parallel)


def test_four_ranks_on_two_cores_name_the_variable(tiny_dir, tmp_path):
    """The guide's four-rank example on a machine that reports two devices stops before any worker
    starts, and the error says how to run it there."""
    job = _job(tiny_dir, tmp_path, {"quantization": "mxfp4", **LAYOUTS["ulysses2-cfg2"]})
    with pytest.raises(RunFailed) as failed:
        run_engine_job(job, timeout=300, env=subprocess_env({"VLLM_OMNI_MXFP4_CPU_DEVICES": "2"}))
    assert "requires 4 device(s)" in str(failed.value)
    assert "set VLLM_OMNI_MXFP4_CPU_DEVICES=4 to run 4 ranks" in str(failed.value)
