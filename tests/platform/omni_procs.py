"""Bounded subprocesses for the engine tests: every wait has a deadline, every process group is reaped.

vLLM-Omni starts stage and worker processes (spawn) that stay in the process group of the
command that started them. Each command here runs in a new session (its own process group), and
:func:`reap_group` ends whatever is left of that group, so a failing or hanging engine never
leaves orphaned workers behind.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

TESTS_DIR = Path(__file__).resolve().parent


def omni_installed() -> bool:
    return importlib.util.find_spec("vllm_omni") is not None and importlib.util.find_spec("vllm") is not None


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    members = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def _wait_group_empty(pgid: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    members = group_members(pgid)
    while members and time.monotonic() < deadline:
        time.sleep(0.2)
        members = group_members(pgid)
    return members


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def reap_group(proc: subprocess.Popen, *, settle: float = 10.0, term_grace: float = 20.0) -> list[int]:
    """End the process group led by ``proc`` (started with ``start_new_session=True``).

    Waits ``settle`` seconds for the group to empty by itself, then sends SIGTERM, waits
    ``term_grace`` seconds, then SIGKILL. Returns the pids that were still alive after ``settle``
    (processes the command left behind); the group is empty when this returns.
    """
    pgid = proc.pid
    if proc.poll() is None:
        _signal_group(pgid, signal.SIGTERM)
    leftover = _wait_group_empty(pgid, settle)
    if leftover:
        _signal_group(pgid, signal.SIGTERM)
        if _wait_group_empty(pgid, term_grace):
            _signal_group(pgid, signal.SIGKILL)
            _wait_group_empty(pgid, 10.0)
    try:
        proc.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10.0)
    return leftover


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


def log_tail(path: Path, chars: int = 6000) -> str:
    text = path.read_text(errors="replace") if path.exists() else "<no log>"
    return text[-chars:]


def run_bounded(args: Sequence[str], *, timeout: float, env: dict[str, str], log: Path) -> None:
    """Run ``python args...`` in a new session; fail with the log's tail on timeout, error or orphans."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            leftover = reap_group(proc)
    if timed_out:
        raise AssertionError(f"{args[0]} did not finish within {timeout:.0f}s; log tail:\n{log_tail(log)}")
    if proc.returncode != 0:
        raise AssertionError(f"{args[0]} exited with {proc.returncode}; log tail:\n{log_tail(log)}")
    if leftover:
        raise AssertionError(f"{args[0]} left processes {leftover} running after it exited")
