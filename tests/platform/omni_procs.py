"""The engine tests' subprocess helpers: the demo's runner, plus the test environment for its commands.

Bounded runs and process-group reaping are :mod:`vllm_omni_mxfp4_tiny.runner`'s, the one reaper of
the project (the demo runs its engines through it too); this module adds what only the tests need:
whether the engines are installed, and the environment a test subprocess gets.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from vllm_omni_mxfp4_tiny.engine_job import Job
from vllm_omni_mxfp4_tiny.runner import RunFailed, log_tail, reap_group, run_bounded, run_engine_job

__all__ = [
    "ENGINE_MARKS",
    "SERVER_MARKS",
    "TESTS_DIR",
    "Job",
    "RunFailed",
    "create_video",
    "log_tail",
    "omni_installed",
    "reap_group",
    "run_bounded",
    "run_engine_job",
    "serve_command",
    "subprocess_env",
    "video_job",
    "wait_until_healthy",
    "wait_video",
]

TESTS_DIR = Path(__file__).resolve().parent


def omni_installed() -> bool:
    return importlib.util.find_spec("vllm_omni") is not None and importlib.util.find_spec("vllm") is not None


ENGINE_MARKS = [
    pytest.mark.slow,
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]
"""The marks of a test module that starts engines."""
SERVER_MARKS = [
    *ENGINE_MARKS,
    # vLLM-Omni's API server imports torchaudio (entrypoints/openai/audio_utils_mixin.py) at start-up.
    pytest.mark.skipif(
        importlib.util.find_spec("torchaudio") is None,
        reason="torchaudio is not installed; vLLM-Omni's API server cannot start without it",
    ),
]
"""The marks of a test module that starts ``vllm serve``."""


def subprocess_env(extra: dict[str, str] | None = None, pythonpath: Sequence[Path] = ()) -> dict[str, str]:
    """The test process' environment with ``pythonpath`` prepended and the CPU platform in auto mode."""
    env = dict(os.environ)
    env.pop("VLLM_OMNI_MXFP4_CPU_PLATFORM", None)
    paths = [str(p) for p in (*pythonpath, TESTS_DIR)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def wait_until_healthy(base: str, server: subprocess.Popen, log: Path, deadline_s: float = 300.0) -> None:
    """Wait until ``GET {base}/health`` answers 200; fail with the log's tail if the server exits first."""
    import requests

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"server exited with {server.returncode} during start-up:\n{log_tail(log)}")
        try:
            if requests.get(f"{base}/health", timeout=10.0).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"server not healthy within {deadline_s:.0f}s:\n{log_tail(log)}")


def create_video(base: str, form: dict[str, str]) -> dict:
    """``POST {base}/v1/videos`` with ``form`` (multipart); the job as created."""
    import requests

    created = requests.post(f"{base}/v1/videos", files={k: (None, v) for k, v in form.items()}, timeout=30)
    assert created.status_code == 200, created.text
    return created.json()


def wait_video(base: str, job: dict, log: Path, deadline_s: float = 180.0) -> dict:
    """Poll ``job`` until it completes (or fails, or the deadline passes: the test fails with the server
    log's tail); the finished job."""
    import requests

    deadline = time.monotonic() + deadline_s
    while job["status"] not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.5)
        job = requests.get(f"{base}/v1/videos/{job['id']}", timeout=10.0).json()
    assert job["status"] == "completed", f"job not completed: {job}\n{log_tail(log)}"
    return job


def video_job(base: str, form: dict[str, str], log: Path, deadline_s: float = 180.0) -> dict:
    """``POST {base}/v1/videos`` with ``form``, then poll until the job completes (or fails, or the
    deadline passes: the test fails with the server log's tail); the finished job."""
    return wait_video(base, create_video(base, form), log, deadline_s)


def serve_command(model: Path, port: int) -> list[str]:
    """``vllm serve MODEL --omni`` on 127.0.0.1:``port``, with this interpreter."""
    import sys

    entry = "vllm.entrypoints.cli.main"
    return [
        sys.executable,
        "-m",
        entry,
        "serve",
        str(model),
        "--omni",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
