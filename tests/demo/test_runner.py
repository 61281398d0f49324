"""The one subprocess runner of the demo and the tests: deadlines, exit codes and process-group reaping.

Every case runs real processes: a command that fails, one that hangs with a child, and one that exits
while its child keeps running. What matters is that no process of the group survives the call.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

from tests.platform.omni_procs import omni_installed, subprocess_env
from tests.support.engine_runs import wan_bf16_job
from vllm_omni_mxfp4_tiny import engine_job, runner
from vllm_omni_mxfp4_tiny.runner import RunFailed, reap_group, run_bounded, run_engine_job

# Starts a child in the same process group that outlives this process unless the group is ended.
SPAWN_CHILD = textwrap.dedent(
    """
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[1], "w").write(str(child.pid))
    """
)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_successful_command_writes_its_log(tmp_path):
    run_bounded(["-c", "print('hello')"], timeout=60, env=os.environ, log=tmp_path / "log")
    assert (tmp_path / "log").read_text() == "hello\n"


def test_a_failing_command_names_its_exit_code_and_log_tail(tmp_path):
    code = "import sys; print('first'); print('the reason'); sys.exit(3)"
    with pytest.raises(RunFailed) as info:
        run_bounded(["-c", code], timeout=60, env=os.environ, log=tmp_path / "log")
    assert info.value.reason == "exited with 3" and info.value.log == tmp_path / "log"
    assert info.value.tail(1) == ["the reason"]
    assert str(tmp_path / "log") in str(info.value) and "the reason" in str(info.value)


def test_a_hanging_command_is_stopped_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = SPAWN_CHILD + "import time; time.sleep(600)\n"
    started = time.monotonic()
    with pytest.raises(RunFailed, match="did not finish within 3 s"):
        run_bounded(["-c", code, str(pid_file)], timeout=3, env=os.environ, log=tmp_path / "log")
    assert time.monotonic() - started < 60
    assert _gone(int(pid_file.read_text()))


@pytest.mark.parametrize("allow", [False, True])
def test_processes_left_behind_are_ended_and_fail_unless_allowed(tmp_path, allow):
    pid_file = tmp_path / "child.pid"
    args = ["-c", SPAWN_CHILD, str(pid_file)]
    if allow:
        run_bounded(args, timeout=60, env=os.environ, log=tmp_path / "log", allow_leftovers=True)
    else:
        with pytest.raises(RunFailed, match=r"left processes \[\d+\] running after it exited"):
            run_bounded(args, timeout=60, env=os.environ, log=tmp_path / "log")
    assert _gone(int(pid_file.read_text()))


def test_reap_group_ends_a_running_leader(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    assert reap_group(proc, settle=5.0) == []  # SIGTERM ends it within the settle time
    assert proc.returncode is not None and _gone(proc.pid)


def test_engine_job_usage(capsys):
    assert engine_job.main([]) == 2
    assert "usage: python -m vllm_omni_mxfp4_tiny.engine_job JOB.json" in capsys.readouterr().err


# ----------------------------------------------------------------------------- warm engine hosts


def test_jobs_share_a_host_when_their_environments_differ_only_in_late_variables():
    base = {"PATH": "/bin", "PYTHONPATH": "/a"}
    traced = {
        **base,
        "VLLM_OMNI_MXFP4_TRACE_FILE": "/tmp/trace.jsonl",
        "PYTEST_CURRENT_TEST": "t.py::x (call)",
    }
    assert runner._host_key(base) == runner._host_key(traced)
    assert runner._host_key(base) != runner._host_key({**base, "PYTHONPATH": "/b"})
    assert runner._host_key(base) != runner._host_key({**base, "VLLM_OMNI_MXFP4_CPU_DEVICES": "2"})


def test_only_the_hosted_modules_are_forked(tmp_path):
    """A ``-c`` command or another module never goes to a host: no host is even started for it."""
    for args in (["-c", "print(1)"], ["-m", "vllm_omni_mxfp4_demo.models"], ["-m"]):
        assert runner._start_hosted(args, {"X": "1"}, tmp_path / "log") is None
    assert runner._host_key({"X": "1"}) not in runner._HOSTS


@pytest.mark.slow
@pytest.mark.omni
@pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed")
def test_a_hosted_job_gives_what_a_fresh_process_gives(tiny_dir, shared_runs, tmp_path):
    """The shared BF16 reference runs forked from a warm host (run_engine_job's default); the same
    job in a fresh interpreter gives the same frames bit for bit and the same report."""
    job = wan_bf16_job(tiny_dir)
    hosted = shared_runs.run(job, timeout=400, trace=True)
    env = subprocess_env({"VLLM_OMNI_MXFP4_TRACE_FILE": str(tmp_path / "trace.jsonl")})
    fresh = run_engine_job(
        dataclasses.replace(job, out=str(tmp_path / "fresh")), timeout=400, env=env, hosted=False
    )
    for index in range(len(job.seeds)):
        assert np.array_equal(np.load(tmp_path / "fresh" / f"frames_{index}.npy"), hosted.frames(index))
    assert (
        fresh["transformers"] == hosted.result["transformers"]
        and fresh["outputs"] == hosted.result["outputs"]
    )
    # the hosted job's log starts with what the host's imports logged, as a fresh process' log does
    first = (tmp_path / "fresh" / "engine.log").read_text().splitlines()[0]
    assert (hosted.out / "engine.log").read_text().splitlines()[0].split("]", 1)[1] == first.split("]", 1)[1]


@pytest.mark.slow
@pytest.mark.omni
@pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed")
def test_a_failing_hosted_job_reports_its_exit_status_and_traceback_and_the_host_serves_on(tmp_path):
    env = dict(subprocess_env(), PYTHONUNBUFFERED="1")
    host = runner.EngineHost(env)
    try:
        for attempt in ("first", "second"):
            out = tmp_path / attempt
            out.mkdir()
            job = engine_job.Job(str(tmp_path / "no-such-model"), str(out))
            (out / "job.json").write_text(json.dumps(dataclasses.asdict(job)))
            proc = host.start(
                "vllm_omni_mxfp4_tiny.engine_job", [str(out / "job.json")], out / "engine.log", env
            )
            assert proc is not None and proc.wait(timeout=300) == 1
            assert runner.reap_group(proc) == []
            log = (out / "engine.log").read_text()
            assert "Traceback (most recent call last)" in log and "no-such-model" in log
            assert host.proc.poll() is None  # the failure was the job's only
        # a module that is not hosted is refused by the host too (the client never sends one)
        proc = host.start("vllm_omni_mxfp4_demo.models", [], tmp_path / "other.log", env)
        assert proc is not None and proc.wait(timeout=60) == 1
        assert "is not one of ('vllm_omni_mxfp4_tiny.engine_job',)" in (tmp_path / "other.log").read_text()
    finally:
        host.close()
    assert host.proc.returncode == 0 and not host.dir.exists()
    host.close()  # again (the exit handler does): a no-op, no descriptor closed twice


def test_commands_running_in_other_threads_are_ended_on_request(tmp_path):
    """What an interrupted caller of several run_bounded at once does: every one fails with its exit
    status, and their groups (a child each) are gone."""
    import threading

    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            runner.run_bounded(
                ["-c", script], timeout=120, env=dict(os.environ), log=tmp_path / f"{name}.log"
            )
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while len(runner._RUNNING) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    groups = set(runner._RUNNING)
    assert len(groups) == 2
    runner.end_running_commands()
    for thread in threads:
        thread.join(timeout=60)
    assert len(errors) == 2 and all(isinstance(e, runner.RunFailed) for e in errors), errors
    assert all("exited with" in e.reason for e in errors)
    assert not runner._RUNNING
    for pgid in groups:
        assert not [p for p in psutil.process_iter() if _pgid(p) == pgid and _alive(p)]


def _pgid(process):
    try:
        return os.getpgid(process.pid)
    except (ProcessLookupError, psutil.NoSuchProcess):
        return None


def _alive(process):
    try:
        return process.status() != psutil.STATUS_ZOMBIE  # a zombie has ended; its parent reaps it
    except psutil.NoSuchProcess:
        return False
