"""Every method under vLLM-Omni's parallel layouts on the CPU platform (real gloo groups, one worker
process per rank), against the same request in one process.

The tiny two-expert Wan2.2 runs one request with true classifier-free guidance, with each of the
three method bundles of :mod:`tests.support.bundles` (two methods per engine, one per expert: every
method this package serves, in three engines per layout), W4A8 by step on :data:`A8_STEPS`.

Layouts (:data:`LAYOUTS`): the MXFP4 guide's four-rank ``tp1 x ulysses2 x cfg2``, ``tp2 x cfg2``
and Ring 2; Ulysses 2, CFG-parallel 2 and TP 2 run as the factors of the four-rank layouts (the
same process groups, one more dimension beside them). The online bundle, which holds W4A8 by step
(the one method with per-rank state: the step index), runs all three; the stored bundles run
``tp2 x cfg2`` with ``--all-bundles``, where every rank loads the stored weights and TP shards
them (what differs between methods in a parallel engine is how the weights load and shard;
sequence parallelism changes only which tokens' activations a rank holds). Each multi-process
engine costs about a minute of the suite on two cores, hence the selection (:data:`BUNDLE_LAYOUTS`).
On a two-core machine four ranks need ``VLLM_OMNI_MXFP4_CPU_DEVICES=4``; without it vLLM-Omni
stops, and the CPU platform's error says so (:func:`test_four_ranks_on_two_cores_name_the_variable`).

What must hold, per bundle and layout:

- The trace (``VLLM_OMNI_MXFP4_TRACE_FILE``, one line per quantized Linear call with the process
  id) shows one process per rank, each running every method of the bundle, every call at the
  precision its route gives at its step, and W4A8 by step on exactly :data:`A8_STEPS` on every rank
  (every CFG branch and every sequence-parallel rank picks the same steps).
- With CFG and Ulysses parallelism the output equals the one-process output bit for bit: each
  rank runs the same computations on its rows (CFG: one guidance branch; Ulysses: a share of the
  tokens, with every head's attention computed whole after the all-to-all).
- TP and Ring change the order of the arithmetic, so the output differs by rounding only, bounded by
  :data:`MIN_PSNR_DB`: TP's row-parallel Linears sum two partial products and all-reduce them instead
  of one GEMM's sum; Ring computes attention one key/value chunk at a time and merges the partial
  results through their log-sum-exp in FP32 instead of one softmax. Measured on this random-weight
  model: 52.4-54.4 dB. The quantized weights themselves are exact: each TP shard
  equals the shard of the one-process weights (``tests/omni/test_wan_tp2.py``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.platform.omni_procs import ENGINE_MARKS, RunFailed, subprocess_env
from tests.support.bundles import A8_LAYERS, BUNDLES, METHODS, bundle, expected_precision, require_bundle
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
    "ring2": {"ring_degree": 2},
    "ulysses2-cfg2": {"ulysses_degree": 2, "cfg_parallel_size": 2},  # the MXFP4 guide's example
    "tp2-cfg2": {"tensor_parallel_size": 2, "cfg_parallel_size": 2},
}
RANKS = {name: int(np.prod(list(kw.values()))) if kw else 1 for name, kw in LAYOUTS.items()}
BUNDLE_LAYOUTS = {
    "online": list(LAYOUTS),
    "checkpoint": ["one", "tp2-cfg2"],
    "nvfp4": ["one", "tp2-cfg2"],
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


Runs = dict[str, tuple[np.ndarray, list[dict]]]


@pytest.fixture(scope="module")
def bundle_runs(tiny_dir: Path, tmp_path_factory) -> Callable[[str], Runs]:
    """``bundle_runs(name)``: bundle ``name``'s runs, per layout of :data:`BUNDLE_LAYOUTS` (the frames
    and the denoising calls of the trace of the same request), run at the first test that asks, so
    that no single test waits for every bundle."""
    done: dict[str, Runs] = {}

    def runs(name: str) -> Runs:
        if name in done:
            return done[name]
        root = tmp_path_factory.mktemp(f"parallel-{name}")
        model, kwargs = bundle(name, tiny_dir, root, A8_STEPS)
        out = {}
        for layout in BUNDLE_LAYOUTS[name]:
            work = root / f"run-{layout}"
            work.mkdir()
            trace = work / "trace.jsonl"
            env = {"VLLM_OMNI_MXFP4_TRACE_FILE": str(trace), **_devices(RANKS[layout])}
            job = _job(model, work, {**kwargs, **LAYOUTS[layout]})
            run_engine_job(job, timeout=600, env=subprocess_env(env))
            calls = [json.loads(line) for line in trace.read_text().splitlines()]
            out[layout] = (np.load(work / "frames_0.npy"), [c for c in calls if c["step"] is not None])
        done[name] = out
        return out

    return runs


def _by_rank(calls: list[dict]) -> dict[int, list[dict]]:
    ranks: dict[int, list[dict]] = defaultdict(list)
    for call in calls:
        ranks[call["pid"]].append(call)
    return ranks


@pytest.mark.parametrize(("bundle", "layout"), [(b, layout) for b in BUNDLES for layout in BUNDLE_LAYOUTS[b]])
def test_every_rank_runs_every_method_at_its_precision(request, bundle_runs, bundle, layout):
    require_bundle(request.config, bundle)
    runs = bundle_runs(bundle)
    ranks = _by_rank(runs[layout][1])
    assert len(ranks) == RANKS[layout]  # one process per rank, each ran quantized Linears
    for calls in ranks.values():
        assert {c["method"] for c in calls} == METHODS[bundle]
        assert [c for c in calls if c["precision"] != expected_precision(bundle, c, A8_STEPS)] == []
        by_step = {c["step"] for c in calls if c["precision"] == "w4a8" and c["prefix"] not in A8_LAYERS}
        assert by_step == (set() if bundle == "checkpoint" else set(A8_STEPS))
        assert {c["step"] for c in calls} == set(range(STEPS))


@pytest.mark.parametrize(("bundle", "layout"), CASES)
def test_parallel_output_equals_one_process(request, bundle_runs, bundle, layout):
    require_bundle(request.config, bundle)
    runs = bundle_runs(bundle)
    single, parallel = runs["one"][0], runs[layout][0]
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
