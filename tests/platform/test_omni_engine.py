"""``Omni(model=<tiny Wan2.2>)`` generating on the CPU platform: TP=1 BF16, quantized, and TP=2 over gloo.

Each engine runs in its own subprocess (the demo's engine job, ``vllm_omni_mxfp4_tiny.engine_job``)
under a deadline, and its whole process group is reaped afterwards; a run that leaves processes
behind fails. One engine serves several requests, so the BF16 run below is shared by the tests of
this module, and with the other files that compare against it (``tests/support/engine_runs.py``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from omni_procs import Job, omni_installed, run_engine_job, subprocess_env

from tests.support.engine_runs import SharedRuns, wan_bf16_job

pytestmark = [
    pytest.mark.slow,
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]

CPU_PLATFORM = "vllm_omni_mxfp4.platform._cpu_platform.CpuOmniPlatform"
FRAMES_SHAPE = (1, 9, 16, 16, 3)  # (batch, frames, height, width, RGB) as Omni returns them

# Quantizable Linears of one tiny Wan expert (2 blocks), in vLLM-Omni's fused naming.
EXPECTED_QUANTIZED = {
    f"blocks.{block}.{name}": shape
    for block in range(2)
    for name, shape in {
        "attn1.to_qkv": "1536x512",
        "attn1.to_out": "512x512",
        "attn2.to_q": "512x512",
        "attn2.to_k": "512x512",
        "attn2.to_v": "512x512",
        "attn2.to_out": "512x512",
        "ffn.net_0.proj": "1024x512",
        "ffn.net_2": "512x1024",
    }.items()
}


def _run_omni(
    model: Path, out: Path, seeds: list[int], *, tp: int = 1, quantization: str | None = None, env=None
) -> dict:
    kwargs = {"tensor_parallel_size": tp} if tp > 1 else {}
    if quantization:
        kwargs["quantization"] = quantization
    job = Job(model=str(model), out=str(out), omni_kwargs=kwargs, seeds=seeds, boundary_ratio=0.875)
    return run_engine_job(job, timeout=240 + 120 * (tp - 1), env=env or subprocess_env())


def _frames(out: Path, index: int) -> np.ndarray:
    return np.load(out / f"frames_{index}.npy")


@pytest.fixture(scope="module")
def bf16_run(tiny_dir: Path, shared_runs: SharedRuns) -> tuple[Path, dict]:
    """One TP=1 BF16 engine, three requests: seed 0, seed 0 again, seed 1 (the shared reference)."""
    run = shared_runs.run(wan_bf16_job(tiny_dir), timeout=240, trace=True)
    return run.out, run.result


def test_tp1_bf16_generates_video_frames(bf16_run: tuple[Path, dict]) -> None:
    out, meta = bf16_run
    assert meta["platform"] == CPU_PLATFORM
    for index, info in enumerate(meta["outputs"]):
        assert info["count"] == 1
        assert info["final_output_type"] == "video"
        assert info["python_type"] == "ndarray"
        frames = _frames(out, index)
        assert frames.shape == FRAMES_SHAPE
        assert frames.dtype == np.float32
        assert np.isfinite(frames).all()
        assert frames.min() >= 0.0 and frames.max() <= 1.0
        assert frames.std() > 1e-3  # an image, not a constant
        assert np.abs(np.diff(frames, axis=1)).max() > 0  # frames differ over time


def test_tp1_same_seed_same_frames(bf16_run: tuple[Path, dict]) -> None:
    out, _ = bf16_run
    np.testing.assert_array_equal(_frames(out, 0), _frames(out, 1))
    assert np.abs(_frames(out, 0) - _frames(out, 2)).max() > 1e-2, "seed 1 gave the frames of seed 0"


def test_tp1_with_a_quantization_plugin(
    tiny_dir: Path, cpu_test_quant_site: Path, bf16_run: tuple[Path, dict], tmp_path: Path
) -> None:
    """``quantization="mxfp4"`` served by a test-only method that a general plugin registers."""
    record = tmp_path / "quantized_layers.txt"
    env = subprocess_env(
        {
            "CPU_TEST_QUANT_RECORD": str(record),
            # The project's own mxfp4 plugin is left out so that the test method owns the name.
            "VLLM_PLUGINS": "cpu,cpu_platform_fixups,cpu_test_quant",
        },
        pythonpath=[cpu_test_quant_site],
    )
    meta = _run_omni(tiny_dir, tmp_path / "out", [0], quantization="mxfp4", env=env)
    assert meta["platform"] == CPU_PLATFORM

    layers = [line.split() for line in record.read_text().splitlines()]
    assert len({pid for pid, _, _ in layers}) == 1
    # Both experts (transformer, transformer_2) quantize every block Linear once each.
    assert Counter(name for _, name, _ in layers) == Counter({name: 2 for name in EXPECTED_QUANTIZED})
    assert all(shape == EXPECTED_QUANTIZED[name] for _, name, shape in layers)

    quantized = _frames(tmp_path / "out", 0)
    reference = _frames(bf16_run[0], 0)
    assert quantized.shape == FRAMES_SHAPE and np.isfinite(quantized).all()
    difference = np.abs(quantized - reference)
    assert difference.max() > 0, "the int8 weights did not reach the computation"
    assert difference.mean() < 0.01, "int8 per-channel weights should stay close to BF16"


def test_tp2_over_gloo_matches_tp1(tiny_dir: Path, bf16_run: tuple[Path, dict], tmp_path: Path) -> None:
    # Two virtual devices whatever the core count (the default is the number of usable cores).
    env = subprocess_env({"VLLM_OMNI_MXFP4_CPU_DEVICES": "2"})
    meta = _run_omni(tiny_dir, tmp_path, [0], tp=2, env=env)
    assert meta["platform"] == CPU_PLATFORM
    frames = _frames(tmp_path, 0)
    assert frames.shape == FRAMES_SHAPE and np.isfinite(frames).all()
    # Sharded GEMMs and a gloo all-reduce change the BF16 summation order: a few BF16 ulps.
    difference = np.abs(frames - _frames(bf16_run[0], 0))
    assert difference.max() < 0.05
    assert difference.mean() < 5e-3
