"""Cache acceleration with quantized models on the CPU platform: cache-dit runs Wan2.2 with every
method (the three bundles of :mod:`tests.support.bundles`), W4A8 by step included; the backends
vLLM-Omni 0.30 cannot run on Wan2.2 are refused at start-up.

What a step index means under a cache (docs/deployment.md): the denoising loop's iteration, counted
from 0 over every iteration whether or not the cache skips work in it (vLLM-Omni's Wan2.2 pipeline
publishes it at the top of each iteration, before the transformer decides anything). A listed step
runs every quantized Linear that computes in it as W4A8: on a step cache-dit serves from its cache,
the first ``Fn_compute_blocks`` blocks still compute (cache-dit decides from their residual) and run
W4A8; the blocks it skips run nothing.

cache-dit is forced to cache (``residual_diff_threshold`` 1.0: every residual counts as similar), so
that which steps it serves from the cache depends only on its warm-up and limits, not on the values:
the BF16 engine with the same cache configuration caches the same steps, and the quantized output
stays within the base quantization error of it (the bound of tests/omni/test_omni_e2e.py, 20 dB).
The flow shift is 1.0 so that cache-dit's own split of the steps between the two experts (it sets
the scheduler's timesteps without the shift) matches the steps each expert runs: with the boundary
at 0.5 the high-noise expert (``transformer``, the one with W4A8 by step) runs steps 0-2 and
cache-dit serves steps 1, 2 and 5 from its cache (measured; the test reads it off the trace), so
:data:`A8_STEPS` holds a computed and a cached step of that expert.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.platform.omni_procs import ENGINE_MARKS, RunFailed, subprocess_env
from tests.support.bundles import BUNDLES, bundle, expected_precision, require_bundle
from vllm_omni_mxfp4.compare.metrics import psnr
from vllm_omni_mxfp4_tiny.engine_job import Job
from vllm_omni_mxfp4_tiny.runner import run_engine_job

pytestmark = ENGINE_MARKS

STEPS = 6
A8_STEPS = [0, 1]
CACHE = {
    "cache_backend": "cache_dit",
    "cache_config": {
        "Fn_compute_blocks": 1,
        "Bn_compute_blocks": 0,
        "max_warmup_steps": 1,
        "residual_diff_threshold": 1.0,
        "max_continuous_cached_steps": -1,
        "max_cached_steps": -1,
    },
    "flow_shift": 1.0,
}
MIN_PSNR_DB = 20.0


def _job(model: Path, out: Path, kwargs: dict) -> Job:
    return Job(
        model=str(model), out=str(out), omni_kwargs=kwargs, seeds=[5], steps=STEPS, guidance_scale=4.0,
        boundary_ratio=0.5,
    )  # fmt: skip


def _run(job: Job, work: Path) -> tuple[np.ndarray, list[dict]]:
    trace = work / "trace.jsonl"
    run_engine_job(job, timeout=400, env=subprocess_env({"VLLM_OMNI_MXFP4_TRACE_FILE": str(trace)}))
    calls = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
    return np.load(work / "frames_0.npy"), [c for c in calls if c["step"] is not None]


@pytest.fixture(scope="module")
def cached(tiny_dir, tmp_path_factory):
    """``cached(name)``: the cached request in BF16 (``"bf16"``) or with a bundle (traced): frames and
    denoising calls, run at the first test that asks."""
    root = tmp_path_factory.mktemp("cache")
    done: dict[str, tuple[np.ndarray, list[dict]]] = {}

    def run(name: str) -> tuple[np.ndarray, list[dict]]:
        if name not in done:
            if name == "bf16":
                done[name] = _run(_job(tiny_dir, root, CACHE), root)
            else:
                model, kwargs = bundle(name, tiny_dir, root, A8_STEPS)
                work = root / f"run-{name}"  # root / name may hold the bundle's model
                work.mkdir()
                done[name] = _run(_job(model, work, {**CACHE, **kwargs}), work)
        return done[name]

    return run


@pytest.fixture
def runs(request, cached):
    """The test's bundle's run (skipped for a stored bundle without ``--all-bundles``) and BF16's."""
    name = request.node.callspec.params["name"]
    require_bundle(request.config, name)
    return {name: cached(name), "bf16": cached("bf16")}


def _request_calls(calls: list[dict]) -> list[dict]:
    """The calls of the last request (the engine's warm-up request runs first, from step 0 again)."""
    start = max(
        i for i in range(len(calls)) if calls[i]["step"] == 0 and (i == 0 or calls[i - 1]["step"] != 0)
    )
    return calls[start:]


@pytest.mark.parametrize("name", BUNDLES)
def test_every_computing_linear_runs_its_precision_at_its_step(runs, name):
    calls = runs[name][1]
    assert calls and [c for c in calls if c["precision"] != expected_precision(name, c, A8_STEPS)] == []


@pytest.mark.parametrize("name", BUNDLES)
def test_the_cache_serves_listed_and_unlisted_steps_and_their_first_block_still_runs(runs, name):
    request = _request_calls(runs[name][1])
    blocks = {
        step: {c["prefix"].split(".")[1] for c in request if c["step"] == step} for step in range(STEPS)
    }
    cached = {step for step, ran in blocks.items() if ran == {"0"}}  # cache-dit skipped block 1
    computed = {step for step, ran in blocks.items() if ran == {"0", "1"}}
    assert cached | computed == set(range(STEPS))  # every step ran at least the first block
    assert cached & set(A8_STEPS) and computed & set(A8_STEPS)  # both kinds of listed step occur
    assert cached - set(A8_STEPS) and computed - set(A8_STEPS)
    if name == "checkpoint":  # no W4A8 by step there
        return
    for step in cached & set(A8_STEPS):  # what still computes on a cached listed step runs W4A8
        assert {c["precision"] for c in request if c["step"] == step} == {"w4a8"}


@pytest.mark.parametrize("name", BUNDLES)
def test_cached_quantized_output_is_within_the_quantization_error_of_cached_bf16(runs, name):
    quantized, bf16 = runs[name][0], runs["bf16"][0]
    assert runs["bf16"][1] == []  # nothing quantized
    assert quantized.shape == bf16.shape and bf16.std() > 0
    assert psnr(quantized, bf16) >= MIN_PSNR_DB


def test_a_cache_backend_wan_cannot_run_is_refused_at_start_up(tiny_dir, tmp_path):
    job = _job(tiny_dir, tmp_path, {"cache_backend": "tea_cache", "quantization": "mxfp4"})
    with pytest.raises(RunFailed) as failed:
        run_engine_job(job, timeout=300, env=subprocess_env())
    text = str(failed.value)
    assert "--cache-backend (cache_backend) = tea_cache is not supported with mxfp4" in text
    assert "use --cache-backend cache_dit" in text
