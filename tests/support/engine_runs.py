"""Engine runs that several test files need, run once per test run and shared, keyed by their content.

An engine job (:class:`~vllm_omni_mxfp4_tiny.engine_job.Job`) gives the same frames and report
whenever it is run with the same model files, engine arguments, requests and environment: the BF16
reference of the tiny Wan2.2 pipeline, say, or one NVFP4 pipeline served with ``mxfp4``, which
several test files compare against. :meth:`SharedRuns.run` runs such a job the first time it is
asked for in this test run and returns the same output directory to every later caller, in any
pytest-xdist worker: the directory lies under the run's common temporary directory, keyed by a hash
of the job's content (the model directory by the bytes of its files, not its path), and a file
lock makes a second worker that asks while the first is running wait for it instead of running it
twice. A failed run leaves no result, so the next caller runs it again (and fails the same way).

Callers only read what the run wrote. A traced run (``trace=True``) records every quantized Linear
call in ``trace.jsonl`` in its directory.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.platform.omni_procs import Job, run_engine_job, subprocess_env

TRACE = "trace.jsonl"
DONE = ".shared-run-done"  # written after the job succeeded (result.json alone may precede a failure)


def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary directory every pytest-xdist worker of this run shares (the base temporary
    directory outside xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def model_digest(model: Path) -> str:
    """A hash of a model directory's files: their relative paths and bytes (tiny pipelines: MBs)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(model)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def job_key(job: Job, env: dict[str, str], trace: bool) -> str:
    """What decides a job's output: its fields (the model by content), the extra environment, tracing."""
    from vllm_omni_mxfp4.compare.run import model_boundary_ratio

    fields = {**dataclasses.asdict(job), "model": model_digest(Path(job.model)), "out": None}
    if job.boundary_ratio is None:  # what the engine gets then (engine_job.engine_kwargs)
        fields["boundary_ratio"] = model_boundary_ratio(job.model)
    blob = json.dumps({"job": fields, "env": env, "trace": trace}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


@dataclasses.dataclass(frozen=True)
class EngineRun:
    """A finished engine job: its output directory and ``result.json``."""

    out: Path
    result: dict[str, Any]

    def frames(self, index: int = 0):
        """Request ``index``'s frames as the job saved them."""
        import numpy as np

        return np.load(self.out / f"frames_{index}.npy")

    def trace(self) -> list[dict[str, Any]]:
        """The traced quantized Linear calls (empty when none ran or the run was not traced)."""
        path = self.out / TRACE
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@dataclasses.dataclass(frozen=True)
class SharedRuns:
    """Engine runs shared by every test of one test run (see the module)."""

    root: Path

    def run(
        self, job: Job, *, timeout: float, env: dict[str, str] | None = None, trace: bool = False
    ) -> EngineRun:
        """``job`` (its ``out`` is ignored) run once for this test run; its output, read-only."""
        env = dict(env or {})
        key = job_key(job, env, trace)
        self.root.mkdir(parents=True, exist_ok=True)
        out = self.root / key
        with open(self.root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not (out / DONE).is_file():
                shutil.rmtree(out, ignore_errors=True)  # what a failed run left (a partial trace)
                extra = {**env, "VLLM_OMNI_MXFP4_TRACE_FILE": str(out / TRACE)} if trace else env
                run_engine_job(
                    dataclasses.replace(job, out=str(out)), timeout=timeout, env=subprocess_env(extra)
                )
                (out / DONE).write_text("")
        return EngineRun(out, json.loads((out / "result.json").read_text()))


def wan_bf16_job(model: Path) -> Job:
    """The BF16 reference of the tiny two-expert Wan2.2 (``model``): one engine, three requests (seed
    0, seed 0 again, seed 1) of the job's default request, the engine's report on. Run traced, it is
    what tests/platform/test_omni_engine.py, tests/omni/test_omni_e2e.py and
    tests/hooks/test_nvfp4_e2e.py compare their engines' frames against."""
    return Job(str(model), "", seeds=[0, 0, 1], boundary_ratio=0.875, report=True)


def nvfp4_served_job(model: Path) -> Job:
    """An NVFP4 pipeline (``model``) served with ``quantization="mxfp4"`` (requantized while it
    loads), one request of the job's default request, the engine's report on: what
    tests/hooks/test_nvfp4_e2e.py checks and tests/convert/test_convert_e2e.py compares with."""
    return Job(str(model), "", omni_kwargs={"quantization": "mxfp4"}, report=True)
