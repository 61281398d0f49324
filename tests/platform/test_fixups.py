"""The WorkerProc output-loop override: still needed by the installed vLLM-Omni, correct, installed only on CPU."""

from __future__ import annotations

import queue
import threading

import pytest
import torch
from omni_procs import omni_installed

pytestmark = [
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]


@pytest.fixture
def worker_proc_cls(monkeypatch: pytest.MonkeyPatch):
    """vLLM-Omni's WorkerProc, with its loop attribute restored after the test."""
    import vllm_omni  # noqa: F401  (resolve the platform before importing the worker module)
    from vllm_omni.diffusion.worker.diffusion_worker import WorkerProc

    monkeypatch.setattr(WorkerProc, "_async_output_loop", WorkerProc.__dict__["_async_output_loop"])
    return WorkerProc


def _stub_worker(worker_proc_cls, items: list) -> tuple[object, list]:
    """A WorkerProc without its MessageQueues: ``items`` queued, replies recorded in a list."""
    proc = object.__new__(worker_proc_cls)
    proc.gpu_id = 0
    proc._async_output_queue = queue.Queue()
    proc._async_output_done = threading.Condition()
    proc._async_output_pending = len(items)
    replies: list = []
    proc._enqueue_result = replies.append
    for item in [*items, None]:
        proc._async_output_queue.put(item)
    return proc, replies


def _large_output():
    from vllm_omni.diffusion.data import DiffusionOutput

    # Above vLLM-Omni's 1 MB threshold, so packing really moves it into shared memory.
    video = torch.linspace(-1.0, 1.0, 400_000).reshape(1, 4, 100, 1000)
    return DiffusionOutput(output=video), video.clone()


def test_upstream_loop_still_fails_without_an_accelerator(worker_proc_cls) -> None:
    """Fails once vLLM-Omni's own loop works on CPU: then delete platform/fixups.py and this test."""
    from vllm_omni_mxfp4.platform.fixups import upstream_async_output_loop

    output, _ = _large_output()
    proc, replies = _stub_worker(worker_proc_cls, [(output, "req-0", None)])
    try:
        upstream_async_output_loop()(proc)
    except (AttributeError, RuntimeError) as exc:  # torch.accelerator.current_accelerator() is None
        assert "type" in str(exc) or "accelerator" in str(exc)
        return
    assert len(replies) == 1
    assert replies[0].error is not None, (
        "vLLM-Omni's WorkerProc._async_output_loop now packs outputs on CPU by itself: "
        "remove vllm_omni_mxfp4.platform.fixups and its installation in install_fixups()"
    )


def test_upstream_queue_protocol_matches_the_override(worker_proc_cls) -> None:
    """The override consumes what WorkerProc._return_result produces: (output, id, device event) items."""
    import types

    from vllm_omni.diffusion.data import AsyncOutputKind

    output, _ = _large_output()
    proc, replies = _stub_worker(worker_proc_cls, [])
    proc._async_output_queue.get()  # drop the stop sentinel _stub_worker queued
    proc.od_config = types.SimpleNamespace(step_execution=False)
    proc.result_mq = object()
    proc._return_result(output, rpc_id="rpc-7")

    assert [r.kind for r in replies] == [AsyncOutputKind.COMPUTE_DONE]
    assert proc._async_output_pending == 1
    queued_output, async_output_id, device_event = proc._async_output_queue.get_nowait()
    assert queued_output is output and async_output_id == replies[0].async_output_id
    assert device_event is None  # record_device_event() has no CPU implementation to wait on


def test_cpu_loop_packs_outputs_into_shared_memory(worker_proc_cls) -> None:
    from vllm_omni.diffusion.data import AsyncOutputKind
    from vllm_omni.diffusion.ipc import unpack_diffusion_output_shm

    from vllm_omni_mxfp4.platform.fixups import cpu_async_output_loop

    first, first_expected = _large_output()
    second, second_expected = _large_output()
    proc, replies = _stub_worker(worker_proc_cls, [(first, "req-0", None), (second, "req-1", None)])
    cpu_async_output_loop(proc)

    assert [r.async_output_id for r in replies] == ["req-0", "req-1"]
    assert all(r.kind is AsyncOutputKind.OUTPUT_READY and r.error is None for r in replies)
    assert proc._async_output_pending == 0
    for reply, expected in zip(replies, (first_expected, second_expected)):
        assert isinstance(reply.output.output, dict)  # replaced by a shared-memory handle
        restored = unpack_diffusion_output_shm(reply.output)
        torch.testing.assert_close(restored.output, expected, rtol=0, atol=0)


def test_cpu_loop_reports_a_packing_failure_and_keeps_going(
    worker_proc_cls, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm_omni.diffusion.ipc as ipc

    from vllm_omni_mxfp4.platform.fixups import cpu_async_output_loop

    def broken_pack(output, d2h_stream=None):
        raise OSError("No space left on device: /dev/shm")

    monkeypatch.setattr(ipc, "pack_diffusion_output_shm", broken_pack)
    first, _ = _large_output()
    second, _ = _large_output()
    proc, replies = _stub_worker(worker_proc_cls, [(first, "req-0", None), (second, "req-1", None)])
    waiter_saw_zero = []

    def drain() -> None:
        with proc._async_output_done:
            waiter_saw_zero.append(
                proc._async_output_done.wait_for(lambda: proc._async_output_pending == 0, 10)
            )

    waiter = threading.Thread(target=drain)
    waiter.start()
    cpu_async_output_loop(proc)
    waiter.join(timeout=10)

    assert [r.async_output_id for r in replies] == ["req-0", "req-1"]
    assert all(r.output is None and "No space left" in r.error for r in replies)
    assert waiter_saw_zero == [True]


def test_install_only_where_the_cpu_platform_is_selected(
    worker_proc_cls, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm_omni_mxfp4.platform as plat
    from vllm_omni_mxfp4 import envs
    from vllm_omni_mxfp4.platform.fixups import cpu_async_output_loop, upstream_async_output_loop

    upstream = worker_proc_cls.__dict__["_async_output_loop"]
    monkeypatch.setenv(envs.CPU_PLATFORM.name, "off")
    plat.install_fixups()
    assert worker_proc_cls.__dict__["_async_output_loop"] is upstream

    monkeypatch.setenv(envs.CPU_PLATFORM.name, "on")
    plat.install_fixups()
    installed = worker_proc_cls.__dict__["_async_output_loop"]
    assert installed is not upstream
    assert upstream_async_output_loop() is upstream
    plat.install_fixups()  # idempotent: loaded once per process, but harmless twice
    assert worker_proc_cls.__dict__["_async_output_loop"] is installed

    output, expected = _large_output()
    proc, replies = _stub_worker(worker_proc_cls, [(output, "req-0", None)])
    proc._async_output_loop()  # the bound method a WorkerProc thread runs
    assert replies[0].error is None
    assert cpu_async_output_loop.__doc__ == installed.__doc__
