"""One request must not take the server down: the CPU platform's request guard.

A request whose decoded frames alone exceed the memory the platform reports fails alone with a
client error naming its size and the limit; a failure whose exception has no message still carries
a reason. Unit tests build each bad request from a good one; the slow test serves the tiny Wan2.2
model with ``vllm serve --omni`` under an address-space limit (``RLIMIT_AS``, set on the server
process before it starts) and checks that an oversized request fails with HTTP 400 and the next
normal one completes on the same server.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import resource
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from omni_procs import log_tail, omni_installed, reap_group, serve_command, subprocess_env, wait_until_healthy

from tests.support.ports import free_port
from vllm_omni_mxfp4.platform.request_guard import (
    MemoryLimit,
    RequestSize,
    failure_reason,
    memory_limit,
    oversize_reason,
    request_size,
)

GIB = 1 << 30
HOST = MemoryLimit(16 * GIB, "the host's total memory")
VALID = {"height": 16, "width": 16, "num_frames": 9, "num_inference_steps": 2, "seed": 0}


def needs_omni(test):
    """Marks a test that imports vLLM-Omni: ``omni``, skipped where it is not installed."""
    skip = pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed")
    return pytest.mark.omni(skip(test))


@dataclasses.dataclass
class Params:
    """The fields of ``OmniDiffusionSamplingParams`` the guard reads (the real class is used below)."""

    height: int | None = 16
    width: int | None = 16
    num_frames: int = 9
    num_outputs_per_prompt: int = 1


# -- the limit -----------------------------------------------------------------------------------


def test_limit_is_host_memory_without_an_address_space_limit() -> None:
    if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY:
        pytest.skip("this test process already runs under RLIMIT_AS")
    limit = memory_limit()
    assert limit.bytes == psutil.virtual_memory().total
    assert "total memory" in limit.source


def test_limit_follows_rlimit_as_of_the_process() -> None:
    """The limit a capped process reports is its cap (a fresh process: the cap cannot be undone)."""
    cap = 3 * GIB
    if psutil.virtual_memory().total <= cap:
        pytest.skip("the host has less memory than the cap")
    code = (
        "from vllm_omni_mxfp4.platform.request_guard import memory_limit as m; l = m(); "
        "print(l.bytes); print(l.source)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY)),
    )
    assert done.returncode == 0, done.stderr
    reported, source = done.stdout.splitlines()
    assert int(reported) == cap
    assert "RLIMIT_AS" in source


# -- the size of a request -----------------------------------------------------------------------


def test_size_of_a_valid_request_and_its_variants() -> None:
    assert request_size("a cat", Params()) == RequestSize(1, 9, 16, 16)
    assert request_size(["a cat", "a dog"], Params(num_outputs_per_prompt=3)) == RequestSize(6, 9, 16, 16)
    assert request_size("a cat", Params(height=None)) is None  # the model's default size applies
    assert request_size("a cat", Params(width=0)) is None
    assert RequestSize(1, 9, 16, 16).decoded_bytes == 9 * 16 * 16 * 3 * 4


def test_a_valid_request_fits_and_an_oversized_one_is_refused_with_size_and_limit() -> None:
    valid = request_size("a cat", Params())
    assert oversize_reason("req-1", valid, HOST) is None
    huge = request_size("a cat", Params(height=100_000, width=100_000))
    reason = oversize_reason("req-1", huge, HOST)
    assert reason is not None
    for fragment in ("'req-1'", "9 frame(s)", "height 100000", "width 100000", "1080000000000 bytes"):
        assert fragment in reason
    assert f"{HOST.bytes} bytes" in reason and HOST.source in reason
    assert "num_frames" in reason  # what to do


@pytest.mark.parametrize("field", ["num_frames", "num_outputs_per_prompt"])
def test_many_frames_or_outputs_are_refused_too(field: str) -> None:
    """16x16 frames are small; 10 million of them are not."""
    params = dataclasses.replace(Params(), **{field: 10_000_000})
    reason = oversize_reason("req-2", request_size("a cat", params), HOST)
    assert reason is not None and "10000000" in reason


def test_the_limit_is_inclusive() -> None:
    size = RequestSize(1, 9, 16, 16)
    assert oversize_reason("r", size, MemoryLimit(size.decoded_bytes, "x")) is None
    assert oversize_reason("r", size, MemoryLimit(size.decoded_bytes - 1, "x")) is not None


# -- a failure's reason --------------------------------------------------------------------------


def _failed_allocation() -> MemoryError:
    try:
        bytearray(1 << 62)  # Python's own allocation failure: MemoryError() without a message
    except MemoryError as exc:
        return exc
    raise AssertionError("allocating 4 EiB succeeded")


def test_an_exception_without_a_message_gets_its_type_and_place() -> None:
    exc = _failed_allocation()
    assert str(exc) == ""
    reason = failure_reason(exc, "req-3")
    assert "MemoryError without a message" in reason and "'req-3'" in reason
    assert "test_request_limits.py" in reason and "_failed_allocation" in reason


def test_an_exception_with_a_message_keeps_it() -> None:
    assert failure_reason(ValueError("height must be positive"), "req-4") == "height must be positive"


# -- inside vLLM-Omni ----------------------------------------------------------------------------


def _request(**fields):
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    params = OmniDiffusionSamplingParams(**{k: v for k, v in {**VALID, **fields}.items() if k != "seed"})
    return OmniDiffusionRequest(prompt="a cat", sampling_params=params, request_id="req-5")


@needs_omni
def test_the_platform_names_the_guarded_runner() -> None:
    import vllm_omni  # noqa: F401
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    from vllm_omni_mxfp4.platform import CpuOmniPlatform
    from vllm_omni_mxfp4.platform.runner import CpuDiffusionModelRunner

    runner_cls = resolve_obj_by_qualname(CpuOmniPlatform.get_diffusion_model_runner_cls())
    assert runner_cls is CpuDiffusionModelRunner and issubclass(runner_cls, DiffusionModelRunner)
    assert CpuOmniPlatform.get_device_total_memory() == memory_limit().bytes


@needs_omni
def test_an_oversized_request_becomes_a_client_error_all_the_way_to_http() -> None:
    """The refusal survives vLLM-Omni's own engine and API code as HTTP 400 with the reason."""
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
    from vllm_omni.entrypoints.openai.video.generation.helpers import (
        _status_code_for_video_failure,
        _video_error_from_exception,
    )
    from vllm_omni.errors import OmniClientError

    from vllm_omni_mxfp4.platform.runner import REQUEST_TOO_LARGE, refusal

    assert refusal(_request()) is None
    request = _request(height=100_000, width=100_000)
    output = refusal(request)
    assert output is not None and output.error_status_code == 400 and output.error_type == REQUEST_TOO_LARGE
    with pytest.raises(OmniClientError) as raised:
        DiffusionEngine.postprocess_output(object(), request, output)  # raises before it reads the engine
    error = _video_error_from_exception(raised.value)
    assert _status_code_for_video_failure(error) == 400
    assert "height 100000" in error.message and "'req-5'" in error.message


@needs_omni
def test_the_runner_refuses_before_touching_the_model() -> None:
    from vllm_omni_mxfp4.platform.runner import CpuDiffusionModelRunner

    runner = object.__new__(CpuDiffusionModelRunner)  # no pipeline, no config: nothing may be used
    output = runner.execute_model(_request(height=100_000, width=100_000), None)
    assert output.error_status_code == 400 and "width 100000" in output.error


@needs_omni
def test_upstream_still_loses_an_empty_reason() -> None:
    """Fails once vLLM-Omni carries an exception without a message as a failure by itself: then
    ``failure_reason`` in the runner is no longer needed. Today ``DiffusionOutput.from_exception``
    keeps ``str(exc)``, an empty string, and the engine takes the request for one that succeeded
    with no output (the client then sees "No video outputs found in generation result.")."""
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine

    engine = type("Engine", (), {"od_config": type("Config", (), {"enable_cpu_offload": False})()})()
    output = DiffusionOutput.from_exception(_failed_allocation())
    assert output.error == ""
    DiffusionEngine.postprocess_output(engine, _request(), output)  # no exception: the reason is gone


@needs_omni
def test_the_runner_names_an_exception_without_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline whose allocation fails in Python (MemoryError()) fails its request with a reason."""
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    from vllm_omni_mxfp4.platform.runner import CpuDiffusionModelRunner

    def failing_forward(self, req, *args, **kwargs):
        raise _failed_allocation()

    monkeypatch.setattr(DiffusionModelRunner, "execute_model", failing_forward)
    runner = object.__new__(CpuDiffusionModelRunner)
    with pytest.raises(RuntimeError, match="MemoryError without a message") as raised:
        runner.execute_model(_request(), None)
    assert "'req-5'" in str(raised.value) and isinstance(raised.value.__cause__, MemoryError)


# -- the API server's record of a failed job ------------------------------------------------------


def _bare_timeout() -> TimeoutError:
    """The engine's async-output wait as it fails: ``asyncio.wait_for`` raising ``TimeoutError()``."""
    import asyncio

    async def wait() -> None:
        await asyncio.wait_for(asyncio.Event().wait(), timeout=0)

    try:
        asyncio.run(wait())
    except TimeoutError as exc:
        return exc
    raise AssertionError("waiting for an event nobody sets did not time out")


@pytest.fixture
def video_helpers(monkeypatch: pytest.MonkeyPatch):
    """vLLM-Omni's video job helpers, with the error function and the worker loop restored afterwards."""
    import vllm_omni  # noqa: F401  (resolve the platform before importing the worker module)
    from vllm_omni.diffusion.worker.diffusion_worker import WorkerProc
    from vllm_omni.entrypoints.openai.video.generation import helpers

    monkeypatch.setattr(helpers, "_video_error_from_exception", helpers._video_error_from_exception)
    monkeypatch.setattr(WorkerProc, "_async_output_loop", WorkerProc.__dict__["_async_output_loop"])
    return helpers


@needs_omni
def test_upstream_still_records_an_empty_reason(video_helpers) -> None:
    """Fails once vLLM-Omni's own job record names an exception without a message: then delete
    platform/job_errors.py and its tests."""
    from vllm_omni_mxfp4.platform.job_errors import upstream_video_error

    exc = _bare_timeout()
    assert str(exc) == ""
    assert upstream_video_error()(exc).message == ""


@needs_omni
def test_the_api_server_records_a_reason_once_the_fixups_are_installed(video_helpers) -> None:
    from vllm_omni_mxfp4.platform import install_fixups
    from vllm_omni_mxfp4.platform.job_errors import install_video_error_fixup

    install_fixups()  # the general plugin, as vLLM-Omni calls it in the API server process
    error = video_helpers._video_error_from_exception(_bare_timeout())
    assert error.code == 500
    assert "TimeoutError without a message" in error.message and "wait_for" in error.message
    named = video_helpers._video_error_from_exception(ValueError("height must be positive"))
    assert named.message == "height must be positive"
    assert install_video_error_fixup() is False  # idempotent


def test_the_fixup_leaves_processes_without_the_video_api_alone() -> None:
    """Engine and worker processes never import the API server's modules (nor torchaudio) for it."""
    code = (
        "import sys; from vllm_omni_mxfp4.platform.job_errors import HELPERS, install_video_error_fixup as i; "
        "print(i(), HELPERS in sys.modules, 'torchaudio' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "False"]


def _batch(*requests):
    from vllm_omni.diffusion.sched.interface import (
        CachedRequestData,
        DiffusionSchedulerOutput,
        NewRequestData,
    )

    new = [NewRequestData(request_id=r.request_id, req=r) for r in requests]
    return DiffusionSchedulerOutput(
        step_id=0,
        scheduled_new_reqs=new,
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        finished_req_ids=set(),
        num_running_reqs=len(new),
        num_waiting_reqs=0,
    )


@needs_omni
def test_a_batch_runs_without_its_oversized_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Request-batch mode: the refused request gets its error, the others reach upstream's batch run."""
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
    from vllm_omni.diffusion.worker.utils import BatchRunnerOutput, RunnerOutput

    from vllm_omni_mxfp4.platform.runner import CpuDiffusionModelRunner

    ran: list[list[str]] = []

    def upstream_batch(self, scheduler_output, *args, **kwargs):  # records what upstream would run
        ids = [new_req.request_id for new_req in scheduler_output.scheduled_new_reqs]
        ran.append(ids)
        return BatchRunnerOutput.from_list(
            [RunnerOutput(i, finished=True, result=DiffusionOutput()) for i in ids]
        )

    monkeypatch.setattr(DiffusionModelRunner, "execute_model_batch", upstream_batch)
    runner = object.__new__(CpuDiffusionModelRunner)
    fits, huge = _request(), dataclasses.replace(_request(height=100_000, width=100_000), request_id="req-6")
    out = runner.execute_model_batch(_batch(fits, huge), None)
    assert ran == [["req-5"]]
    assert out["req-5"].result.error is None
    assert out["req-6"].result.error_status_code == 400 and "height 100000" in out["req-6"].result.error
    ran.clear()
    alone = runner.execute_model_batch(_batch(huge), None)
    assert ran == [] and alone["req-6"].result.error_status_code == 400


# -- vllm serve --omni under a memory cap --------------------------------------------------------

SERVER_CAP = 10 * GIB
JOB_DEADLINE_S = 180.0


def _job(base: str, form: dict[str, str]) -> tuple[int, dict]:
    """Create a video job and wait for its end: (HTTP status of the last GET, job)."""
    import requests

    created = requests.post(f"{base}/v1/videos", files={k: (None, v) for k, v in form.items()}, timeout=30)
    assert created.status_code == 200, created.text
    job = created.json()
    deadline = time.monotonic() + JOB_DEADLINE_S
    status = created.status_code
    while job["status"] not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.5)
        answer = requests.get(f"{base}/v1/videos/{job['id']}", timeout=10)
        status, job = answer.status_code, answer.json()
    return status, job


def _form(**fields: int) -> dict[str, str]:
    return {"prompt": "a cat walking on the grass", **{k: str(v) for k, v in {**VALID, **fields}.items()}}


@pytest.mark.slow
@pytest.mark.omni
@pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed")
@pytest.mark.skipif(importlib.util.find_spec("torchaudio") is None, reason="the API server needs torchaudio")
@pytest.mark.skipif(
    psutil.virtual_memory().total <= SERVER_CAP, reason="the host has less memory than the cap"
)
def test_serve_refuses_an_oversized_request_and_serves_the_next(tiny_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            serve_command(tiny_dir, port),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=subprocess_env(),
            start_new_session=True,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (SERVER_CAP, resource.RLIM_INFINITY)),
        )
    try:
        wait_until_healthy(base, server, log)
        # 100000x100000 exceeds any host; 81 frames of 4096x4096 (15.2 GiB) exceed only the cap.
        for oversized, fragments in (
            (_form(height=100_000, width=100_000), ("height 100000", "width 100000")),
            (_form(height=4096, width=4096, num_frames=81), ("81 frame(s)", "height 4096")),
        ):
            status, job = _job(base, oversized)
            assert status == 400 and job["status"] == "failed", f"{job}\n{log_tail(log)}"
            message = job["error"]["message"]
            assert all(fragment in message for fragment in fragments), message
            assert f"({SERVER_CAP} bytes)" in message and "RLIMIT_AS" in message
        status, job = _job(base, _form())
        assert status == 200 and job["status"] == "completed", f"{job}\n{log_tail(log)}"
        assert server.poll() is None
    finally:
        leftover = reap_group(server, settle=30.0)
    assert not leftover, f"server processes {leftover} outlived SIGTERM by 30s"
