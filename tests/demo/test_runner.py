"""The one subprocess runner of the demo and the tests: deadlines, exit codes and process-group reaping.

Every case runs real processes: a command that fails, one that hangs with a child, and one that exits
while its child keeps running. What matters is that no process of the group survives the call.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from vllm_omni_mxfp4_tiny import engine_job
from vllm_omni_mxfp4_tiny.runner import RunFailed, reap_group, run_bounded

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
