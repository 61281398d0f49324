"""Bounded subprocesses: every command gets a deadline and its whole process group is reaped.

vLLM-Omni starts stage and worker processes (spawn) that stay in the process group of the command
that started them. :func:`run_bounded` runs each command in a new session (its own process group)
and :func:`reap_group` ends whatever is left of that group, so a failing or hanging engine never
leaves orphaned workers behind. The demo runs each mode this way, and the engine tests run their
engines, servers and documentation blocks through the same two functions.

:func:`run_engine_job` runs :mod:`vllm_omni_mxfp4_tiny.engine_job` (one ``Omni``, its frames
saved) as such a command and returns what the job reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from .engine_job import Job


class RunFailed(RuntimeError):
    """A bounded command timed out, exited non-zero, or left processes running after it exited.

    ``reason`` says which in a few words, ``log`` is the file holding the command's output, and the
    message ends with the log's tail, so a failing test shows why.
    """

    def __init__(self, command: str, reason: str, log: Path) -> None:
        self.reason, self.log = reason, log
        super().__init__(f"{command} {reason} (log: {log}); log tail:\n{log_tail(log)}")

    def tail(self, lines: int = 3) -> list[str]:
        """The last ``lines`` non-blank lines of the log."""
        return [line for line in log_tail(self.log).splitlines() if line.strip()][-lines:]


def log_tail(path: Path, chars: int = 6000) -> str:
    """The last ``chars`` characters of a log file (``<no log>`` when it does not exist)."""
    text = path.read_text(errors="replace") if path.exists() else "<no log>"
    return text[-chars:]


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

    A leader still running gets SIGTERM at once. Then waits ``settle`` seconds for the group to
    empty by itself, sends SIGTERM, waits ``term_grace`` seconds, and sends SIGKILL. Returns the pids
    that were still alive after ``settle`` (processes the command left behind); the group is empty
    and the leader reaped when this returns.
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


def run_bounded(
    args: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str],
    log: Path,
    allow_leftovers: bool = False,
) -> None:
    """Run ``python args...`` in a new session with its output in ``log``; reap its group afterwards.

    Raises :class:`RunFailed` when it does not finish within ``timeout`` seconds, exits non-zero,
    or (unless ``allow_leftovers``) leaves processes running after it exited. An interrupt
    (Ctrl-C, SIGTERM turned into SystemExit) ends the group on the way out.
    """
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            leftover = reap_group(proc)
    command = " ".join(args[:2]) if args[0] == "-m" else args[0]
    if timed_out:
        raise RunFailed(command, f"did not finish within {timeout:.0f} s", log)
    if proc.returncode != 0:
        raise RunFailed(command, f"exited with {proc.returncode}", log)
    if leftover and not allow_leftovers:
        raise RunFailed(command, f"left processes {leftover} running after it exited", log)


def run_engine_job(
    job: Job,
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    allow_leftovers: bool = False,
) -> dict[str, Any]:
    """Run :mod:`~vllm_omni_mxfp4_tiny.engine_job` on ``job`` in its own process group.

    ``job.out`` receives ``job.json``, ``engine.log`` and what the job writes (see
    :mod:`~vllm_omni_mxfp4_tiny.engine_job`). Returns the job's ``result.json``; raises
    :class:`RunFailed` as :func:`run_bounded` does. ``env`` defaults to this process' environment.
    """
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps(dataclasses.asdict(job), indent=2))
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    args = ["-m", "vllm_omni_mxfp4_tiny.engine_job", str(out / "job.json")]
    run_bounded(args, timeout=timeout, env=env, log=out / "engine.log", allow_leftovers=allow_leftovers)
    return json.loads((out / "result.json").read_text())
