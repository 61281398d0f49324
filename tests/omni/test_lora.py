"""LoRA on quantized models: a peft adapter runs as a BF16 branch next to each quantized Linear.

vLLM-Omni's ``peft`` LoRA backend wraps every vLLM Linear of the transformers: the wrapper calls the
base layer's quant method (ours: the MXFP4 kernel on the packed weight) and adds the adapter's
``x @ A.T @ B.T`` in the model dtype (BF16) to its output. The quantized weight is not touched, so
adapters switch per request. The fused self-attention ``attn1.to_qkv`` gets the adapter's ``to_q`` /
``to_k`` / ``to_v`` modules on its three output slices.

Four engines (subprocess engine jobs with the call trace and each step's latents,
``VLLM_OMNI_MXFP4_TRAJECTORY_DIR``), all started with ``lora_path`` = adapter A, run the same six
requests, all with the same seed (:data:`REQUESTS`):

- quantized, one engine per method bundle of :mod:`tests.support.bundles` (every method, two per
  engine: at load with W4A8 by layer and step next to DualScale; an offline checkpoint with Smooth
  and MXFP8 blocks next to offline DualScale; an NVFP4 checkpoint next to DualScale at load);
- BF16: the reference.

The requests: A; B (another adapter: a switch); A again (the switch back); A at scale 0 (the adapter
suspended); none (no adapter); QKV (A's ``to_q`` / ``to_k`` / ``to_v`` pairs alone: the slices of the
fused QKV). Every request names its adapter: vLLM-Omni switches the start-up adapter off at the
first request without one (its warm-up included).

The tests' shared BF16 run (:func:`tests.support.engine_runs.wan_bf16_job`: the same request on an
engine without LoRA) is the model without LoRA. One more engine start, which ends before loading
any weight, shows that the ``distill`` backend (the LoRA merged into the weights) is refused with
our methods.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from tests.platform.omni_procs import ENGINE_MARKS, Job, RunFailed, run_engine_job, subprocess_env
from tests.support.bundles import BUNDLES, METHODS, bundle, expected_precision, require_bundle
from tests.support.engine_runs import wan_bf16_job
from tests.support.lora import QKV_SLICES, STRENGTH, adapter_modules, write_adapter
from vllm_omni_mxfp4.compare.metrics import psnr


def engine_test(test):
    """Mark ``test`` as one that starts engines."""
    for mark in ENGINE_MARKS:
        test = mark(test)
    return test


#: Request name -> (adapter, scale) or None (no adapter), in the order the engines run them.
REQUESTS: dict[str, tuple[str, float] | None] = {
    "A": ("A", 1.0),
    "B": ("B", 1.0),
    "A again": ("A", 1.0),
    "A at scale 0": ("A", 0.0),
    "none": None,
    "QKV": ("QKV", 1.0),
}
WITH_LORA = ("A", "B", "QKV")
#: Each adapter's strength: the RMS of its ``B @ A`` against the base weight's. The QKV adapter
#: changes 2 of each block's 8 Linears, so it is twice as strong, for an effect on the video as
#: clearly beyond the base's quantization error as the others'.
STRENGTHS = {"A": STRENGTH, "B": STRENGTH, "QKV": 2 * STRENGTH}
EXPERTS = ("transformer", "transformer_2")
A8_STEPS = [0]  # the bundles' W4A8 by step: the first step (the high-noise expert, transformer)
LAYERS_PER_EXPERT = 16  # 2 blocks x (to_qkv, to_out, attn2 to_q / to_k / to_v / to_out, ffn in / out)
CFG_PASSES = 2  # each denoising step runs one expert (the boundary splits the steps) twice: guidance


def relative_error(x: np.ndarray, reference: np.ndarray) -> float:
    """``|x - reference| / |reference|`` (Euclidean norms, float64)."""
    x, reference = x.astype(np.float64), reference.astype(np.float64)
    return float(np.linalg.norm(x - reference) / np.linalg.norm(reference))


@pytest.fixture(scope="module")
def adapters(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A and B: every quantized block Linear (the fused QKV as its slices), seeds 1 and 2; QKV: A's
    pairs of the fused QKV's slices alone."""
    root = tmp_path_factory.mktemp("lora-adapters")
    return {
        "A": write_adapter(tiny_dir, root / "a", seed=1),
        "B": write_adapter(tiny_dir, root / "b", seed=2),
        "QKV": write_adapter(tiny_dir, root / "qkv", seed=1, targets=QKV_SLICES, strength=STRENGTHS["QKV"]),
    }


def lora_job(model: Path, out: Path, adapters: dict[str, Path], **omni_kwargs) -> Job:
    """One engine started with adapter A, running :data:`REQUESTS` with the shared BF16 reference's
    request and seed (:func:`wan_bf16_job`), so that its "none" request is that run's first one."""
    reference = wan_bf16_job(model)
    lora = [None if r is None else (str(adapters[r[0]]), r[1]) for r in REQUESTS.values()]
    return dataclasses.replace(
        reference,
        out=str(out),
        omni_kwargs={**reference.omni_kwargs, "lora_path": str(adapters["A"]), **omni_kwargs},
        seeds=[reference.seeds[0]] * len(REQUESTS),
        lora=lora,
        report=True,
    )


class Run:
    """A finished LoRA engine job, by request name: frames and final latents; its call trace split
    into the requests' calls; the engine's report."""

    def __init__(self, job: Job, result: dict, steps: list[Path], bundle: str | None) -> None:
        self.bundle = bundle  # the method bundle (None: the BF16 engine)
        out = Path(job.out)
        self.frames = {name: np.load(out / f"frames_{i}.npy") for i, name in enumerate(REQUESTS)}
        # Each request saved one latent per step, after the warm-up's.
        assert len(steps) >= len(REQUESTS) * job.steps, steps
        per_request = steps[len(steps) - len(REQUESTS) * job.steps :]
        self.latents = {
            name: np.load(per_request[(i + 1) * job.steps - 1]) for i, name in enumerate(REQUESTS)
        }
        trace = out / "trace.jsonl"
        self.calls = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
        self.linears = {t["name"]: t["linears"] for t in result["transformers"]}
        self.calls_per_request = job.steps * CFG_PASSES * LAYERS_PER_EXPERT

    def request_calls(self) -> dict[str, list[dict]]:
        """The traced calls of each request: the trace's last calls (the engine's warm-up ran first),
        one pass of one expert's quantized Linears per step and guidance branch each."""
        each = self.calls_per_request
        assert len(self.calls) >= len(REQUESTS) * each, len(self.calls)
        tail = self.calls[len(self.calls) - len(REQUESTS) * each :]
        return {name: tail[i * each : (i + 1) * each] for i, name in enumerate(REQUESTS)}


@pytest.fixture(scope="module")
def steps_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the engines save each denoising step's latents (one directory for the module's engines:
    the engine host is chosen by the environment, so they share one)."""
    return tmp_path_factory.mktemp("lora-steps")


def engine_env(job: Job, steps_dir: Path) -> dict[str, str]:
    """The test environment with the call trace into ``job.out`` and the latents into ``steps_dir``."""
    return subprocess_env(
        {
            "VLLM_OMNI_MXFP4_TRACE_FILE": str(Path(job.out) / "trace.jsonl"),
            "VLLM_OMNI_MXFP4_TRAJECTORY_DIR": str(steps_dir),
        }
    )


def _run(job: Job, steps_dir: Path, bundle: str | None = None) -> Run:
    before = set(steps_dir.iterdir())
    result = run_engine_job(job, timeout=400, env=engine_env(job, steps_dir))
    (Path(job.out) / "steps").mkdir()
    steps = []
    for path in sorted(set(steps_dir.iterdir()) - before):  # <pid>-<step of the process>.npy
        steps.append(Path(shutil.move(path, Path(job.out) / "steps" / path.name)))
    return Run(job, result, steps, bundle)


@pytest.fixture(scope="module", params=BUNDLES)
def quant(request, tiny_dir: Path, adapters: dict[str, Path], steps_dir: Path, tmp_path_factory) -> Run:
    """The quantized engine of one method bundle."""
    require_bundle(request.config, request.param)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    model, kwargs = bundle(request.param, tiny_dir, root, A8_STEPS)
    out = root / "out"
    out.mkdir()
    return _run(lora_job(model, out, adapters, **kwargs), steps_dir, request.param)


@pytest.fixture(scope="module")
def bf16(tiny_dir: Path, adapters: dict[str, Path], steps_dir: Path, tmp_path_factory) -> Run:
    return _run(lora_job(tiny_dir, tmp_path_factory.mktemp("lora-bf16"), adapters), steps_dir)


@pytest.fixture(scope="module")
def quantization_psnr(quant: Run, bf16: Run) -> float:
    """The base's quantization error in the frames: PSNR of the quantized model against BF16, no LoRA."""
    return psnr(quant.frames["none"], bf16.frames["none"])


@engine_test
def test_without_the_adapter_the_model_is_the_base_model(
    quant: Run, bf16: Run, tiny_dir: Path, shared_runs
) -> None:
    # Scale 0 suspends the adapter and no adapter switches it off: the same computation.
    for run in (quant, bf16):
        np.testing.assert_array_equal(run.frames["A at scale 0"], run.frames["none"])
    # The LoRA wrappers with no adapter active give the frames of an engine without LoRA, bit for bit.
    reference = shared_runs.run(wan_bf16_job(tiny_dir), timeout=400, trace=True)
    np.testing.assert_array_equal(bf16.frames["none"], reference.frames(0))
    assert bf16.calls == []  # the BF16 engine quantized nothing


@engine_test
def test_the_adapters_change_the_video_far_beyond_the_quantization_error(
    quant: Run, bf16: Run, quantization_psnr: float
) -> None:
    """Each adapter's effect is at least twice the base's quantization error (RMS; 6 dB), in both
    engines, so that the comparison below can tell a LoRA applied from one left out; and the video
    stays the base model's video, changed (PSNR >= 20 dB: an RMS change under 0.1 of the range)."""
    for name in WITH_LORA:
        for run in (quant, bf16):
            frames, base = run.frames[name], run.frames["none"]
            assert np.isfinite(frames).all() and frames.min() >= 0.0 and frames.max() <= 1.0
            effect = psnr(frames, base)
            assert 20.0 <= effect <= quantization_psnr - 6.0, (name, effect, quantization_psnr)


@engine_test
def test_the_quantized_model_with_a_lora_matches_bf16_with_it_within_the_base_error(
    quant: Run, bf16: Run
) -> None:
    """Quantized + LoRA against BF16 + LoRA, in the denoised latents (the transformers' output,
    before the VAE), relative to the base's own error there (quantized vs BF16, no LoRA).

    The LoRA branch is computed exactly as in the BF16 engine, but its input carries the quantized
    layers' error, which it passes on with its own gain: at strength ``s`` (:data:`STRENGTHS`), a
    LoRA'd layer's output is the base layer's plus an independent ``s`` times as large one,
    so an error in its input reaches its output up to ``sqrt(1 + s**2)`` times as strongly as in the
    base layer's. The bound is that factor on the base's error (``s = 2``: 2.24, the QKV adapter's
    ``s = 4``: 4.12).
    A LoRA missing from the quantized model would leave an error of its whole effect there (2.3 to 6
    times the base error), and quantized frames equal to the quantized base's, which the frame check
    refuses."""
    base = relative_error(quant.latents["none"], bf16.latents["none"])
    assert base > 0  # the quantized engine quantized
    for name in WITH_LORA:
        bound = math.sqrt(1 + STRENGTHS[name] ** 2) * base
        error = relative_error(quant.latents[name], bf16.latents[name])
        assert error <= bound, (name, error, base)
        # In the frames, the quantized LoRA model is nearer the BF16 LoRA model than its own base.
        assert psnr(quant.frames[name], bf16.frames[name]) > psnr(quant.frames[name], quant.frames["none"]), (
            name
        )


@engine_test
def test_adapters_switch_between_requests(quant: Run, bf16: Run, quantization_psnr: float) -> None:
    for run in (quant, bf16):
        # A, then B, then A again: the first A's frames, bit for bit.
        np.testing.assert_array_equal(run.frames["A again"], run.frames["A"])
        np.testing.assert_array_equal(run.latents["A again"], run.latents["A"])
        # B is another adapter, not A left active.
        assert psnr(run.frames["B"], run.frames["A"]) <= quantization_psnr - 6.0


@engine_test
def test_every_quantized_linear_runs_its_kernel_under_the_lora(quant: Run) -> None:
    """The report: each transformer's quantized Linears sit inside a LoRA wrapper (``<layer>.base_layer``)
    and still hold their method. The trace: every request, with or without an adapter, ran the same
    quantized Linear objects through our kernel, each call at the precision its route gives."""
    found = set()
    for component in EXPERTS:
        linears = quant.linears[component]
        assert len(linears) == LAYERS_PER_EXPERT
        for entry in linears:
            assert entry["layer"].endswith(".base_layer") and entry["backend"] == "emulated", entry
            routed = {
                "method": entry["method"],
                "prefix": entry["layer"].removesuffix(".base_layer"),
                "step": None,
            }
            assert entry["precision"] == expected_precision(quant.bundle, routed, A8_STEPS), entry
            found.add((entry["layer"].removesuffix(".base_layer"), entry["method"]))
    assert {method for _, method in found} == METHODS[quant.bundle]
    requests = quant.request_calls()
    expected = Counter((c["layer"], c["prefix"], c["method"]) for c in requests["none"])
    assert {(prefix, method) for _, prefix, method in expected} == found  # all 32, both experts
    for name, calls in requests.items():
        assert Counter((c["layer"], c["prefix"], c["method"]) for c in calls) == expected, name
        assert [c for c in calls if c["precision"] != expected_precision(quant.bundle, c, A8_STEPS)] == [], (
            name
        )
        assert {c["backend"] for c in calls} == {"emulated"}, name


@engine_test
def test_the_fused_qkv_takes_the_adapters_q_k_v_slices(
    quant: Run, adapters: dict[str, Path], tiny_dir: Path
) -> None:
    """The QKV adapter holds ``to_q`` / ``to_k`` / ``to_v`` pairs for every block; the engine has no
    such Linears, only the fused ``attn1.to_qkv`` (quantized, LoRA-wrapped), which therefore carried
    the QKV request's whole effect (the tests above: beyond the quantization error, and within the
    bound of BF16 with the same adapter)."""
    tensors = load_file(str(adapters["QKV"] / "adapter_model.safetensors"))
    modules = {key.removeprefix("base_model.model.").rsplit(".", 2)[0] for key in tensors}
    assert modules == set(adapter_modules(tiny_dir, QKV_SLICES))
    for component in EXPERTS:
        layers = {e["layer"] for e in quant.linears[component]}
        blocks = {layer.split(".")[1] for layer in layers}
        for block in blocks:
            assert f"blocks.{block}.attn1.to_qkv.base_layer" in layers
            assert not any(f"blocks.{block}.{s}." in layer for s in QKV_SLICES for layer in layers)
    qkv_calls = [c for c in quant.request_calls()["QKV"] if c["prefix"].endswith("attn1.to_qkv")]
    assert {c["method"] for c in qkv_calls} == METHODS[quant.bundle]


@engine_test
def test_a_lora_merged_into_the_weights_is_refused_at_start_up(
    tiny_dir: Path, adapters: dict[str, Path], steps_dir: Path, tmp_path: Path
) -> None:
    job = Job(
        str(tiny_dir),
        str(tmp_path / "out"),
        omni_kwargs={
            **bundle("online", tiny_dir, tmp_path, A8_STEPS)[1],
            "lora_backend": "distill",
            "lora_path": str(adapters["A"]),
        },
    )
    with pytest.raises(RunFailed) as failed:
        run_engine_job(job, timeout=400, env=engine_env(job, steps_dir))
    assert failed.value.reason.startswith("exited with"), failed.value
    log = (tmp_path / "out" / "engine.log").read_text()
    assert (
        "--lora-backend distill (lora_backend='distill') = distill is not supported with "
        "mxfp4, mxfp4_dualscale (Wan22Pipeline" in log
    ), log[-3000:]
    assert "Instead, use --lora-backend peft" in log, log[-3000:]
    assert not list((tmp_path / "out").glob("frames_*.npy"))  # refused before any request


def test_the_engine_job_checks_its_lora_entries() -> None:
    """``Job.lora``: one entry per seed, each null or [adapter directory, scale >= 0]."""
    good = {"model": "m", "out": "o", "seeds": [0, 0], "lora": [["/adapters/a", 1.0], None]}
    assert Job.from_dict(json.loads(json.dumps(good))).lora == [["/adapters/a", 1.0], None]
    assert Job.from_dict({"model": "m", "out": "o"}).lora == []
    with pytest.raises(ValueError, match=r"lora has 1 entries for 2 seeds; expected one per seed"):
        Job.from_dict({**good, "lora": [None]})
    for bad in (["/adapters/a"], ["/adapters/a", -1.0], ["", 1.0], [1.0, "/adapters/a"], ["/a", True], "/a"):
        with pytest.raises(ValueError, match=r"lora\[1\] is .*; expected null or \[adapter_dir, scale\]"):
            Job.from_dict({**good, "lora": [None, bad]})
