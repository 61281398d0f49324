"""Bounded subprocesses: every command gets a deadline and its whole process group is reaped.

vLLM-Omni starts stage and worker processes (spawn) that stay in the process group of the command
that started them. :func:`run_bounded` runs each command in a new session (its own process group)
and :func:`reap_group` ends whatever is left of that group, so a failing or hanging engine never
leaves orphaned workers behind. The demo runs each mode this way, and the engine tests run their
engines, servers and documentation blocks through the same two functions.

:func:`run_engine_job` runs :mod:`vllm_omni_mxfp4_tiny.engine_job` (one ``Omni``, its frames
saved) as such a command and returns what the job reported. By default the job is forked from a warm
:mod:`~vllm_omni_mxfp4_tiny.engine_host` (one per environment, one more for each job that runs while the others are busy, started on first use, ended when this
process exits), which saves the ~12 s that importing vLLM-Omni costs every fresh process; the job
still gets a process, a session and a log of its own, so deadlines and reaping work the same.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from .engine_host import HOSTED_MODULES, LATE_VARIABLES
from .engine_job import Job

logger = logging.getLogger(__name__)


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


def reap_group(
    proc: subprocess.Popen | HostedProcess, *, settle: float = 10.0, term_grace: float = 20.0
) -> list[int]:
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


#: Process groups of the commands :func:`run_bounded` runs now, in any thread.
_RUNNING: set[int] = set()
_RUNNING_LOCK = threading.Lock()


def end_running_commands() -> None:
    """SIGTERM every command :func:`run_bounded` runs now, in any thread: each ``run_bounded`` then
    fails with its exit status and reaps its group. For a caller that runs several at once and is
    interrupted."""
    with _RUNNING_LOCK:
        groups = list(_RUNNING)
    for pgid in groups:
        _signal_group(pgid, signal.SIGTERM)


def run_bounded(
    args: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str],
    log: Path,
    allow_leftovers: bool = False,
    hosted: bool = False,
) -> None:
    """Run ``python args...`` in a new session with its output in ``log``; reap its group afterwards.

    Raises :class:`RunFailed` when it does not finish within ``timeout`` seconds, exits non-zero,
    or (unless ``allow_leftovers``) leaves processes running after it exited. An interrupt
    (Ctrl-C, SIGTERM turned into SystemExit) ends the group on the way out. With ``hosted``, a
    ``-m`` command of :data:`~vllm_omni_mxfp4_tiny.engine_host.HOSTED_MODULES` is forked from the
    free warm host of ``env`` where there is one (:func:`engine_hosts`), else it starts fresh.
    """
    with open(log, "wb") as out:
        proc: subprocess.Popen | HostedProcess | None = _start_hosted(args, env, log) if hosted else None
        if proc is None:
            proc = subprocess.Popen(
                [sys.executable, *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,
            )
        timed_out = False
        with _RUNNING_LOCK:
            _RUNNING.add(proc.pid)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            leftover = reap_group(proc)
            with _RUNNING_LOCK:
                _RUNNING.discard(proc.pid)
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
    hosted: bool = True,
) -> dict[str, Any]:
    """Run :mod:`~vllm_omni_mxfp4_tiny.engine_job` on ``job`` in its own process group.

    ``job.out`` receives ``job.json``, ``engine.log`` and what the job writes (see
    :mod:`~vllm_omni_mxfp4_tiny.engine_job`). Returns the job's ``result.json``; raises
    :class:`RunFailed` as :func:`run_bounded` does. ``env`` defaults to this process' environment.
    ``hosted`` (the default) forks the job from the warm engine host of ``env``; ``False`` starts a
    fresh interpreter.
    """
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps(dataclasses.asdict(job), indent=2))
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    args = ["-m", "vllm_omni_mxfp4_tiny.engine_job", str(out / "job.json")]
    run_bounded(
        args, timeout=timeout, env=env, log=out / "engine.log", allow_leftovers=allow_leftovers, hosted=hosted
    )
    return json.loads((out / "result.json").read_text())


# ----------------------------------------------------------------------------- warm engine hosts

#: At most this many hosts per process: one per distinct environment, and one more for an environment
#: whose hosts are all busy (jobs run concurrently, as the demo's modes do); a job that finds none
#: free starts fresh.
MAX_HOSTS = 4
#: How long a host may take to import what it preloads before its jobs start fresh instead.
HOST_READY_TIMEOUT_S = 600.0


class _Replies:
    """JSON lines from a host's reply pipe, read with deadlines."""

    def __init__(self, fd: int) -> None:
        self.fd, self._buffer, self.closed = fd, b"", False

    def read(self, timeout: float | None) -> dict[str, Any] | None:
        """The next reply; ``None`` when none came within ``timeout`` s; raises EOFError once the host is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            if self.closed:
                raise EOFError("engine host exited")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                self.closed = True
                continue
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)


class HostedProcess:
    """A job forked by an :class:`EngineHost`, with the part of ``subprocess.Popen`` that
    :func:`reap_group` and :func:`run_bounded` use (``pid``, ``returncode``, ``poll``, ``wait``, ``kill``).

    Its process group is its pid (the child calls ``setsid``). If the host dies while the job runs,
    the job counts as exited with status 255 and its group is reaped as usual.
    """

    def __init__(self, host: EngineHost, pid: int) -> None:
        self.host, self.pid, self.returncode = host, pid, None

    def _take(self, timeout: float | None) -> bool:
        if self.returncode is not None:
            return True
        try:
            reply = self.host.replies.read(timeout)
        except EOFError:
            reply = {"pid": self.pid, "returncode": 255}
        if reply is None:
            return False
        if reply.get("pid") != self.pid or "returncode" not in reply:
            raise RuntimeError(f"engine host: unexpected reply {reply} while job {self.pid} runs")
        self.returncode = int(reply["returncode"])
        self.host.busy.release()
        return True

    def poll(self) -> int | None:
        self._take(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._take(timeout):
            raise subprocess.TimeoutExpired(f"engine job {self.pid}", timeout or 0.0)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


class EngineHost:
    """The client of one :mod:`~vllm_omni_mxfp4_tiny.engine_host` process, started with ``env``
    (without its :data:`~vllm_omni_mxfp4_tiny.engine_host.LATE_VARIABLES`). One job at a time."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.dir = Path(tempfile.mkdtemp(prefix="vllm-omni-mxfp4-engine-host-"))
        self.log = self.dir / "host.log"
        self.busy = threading.Lock()
        self.ready: bool | None = None  # None until the host said it is ready or failed
        read_fd, write_fd = os.pipe()
        try:
            with open(self.log, "wb") as out:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "vllm_omni_mxfp4_tiny.engine_host", str(write_fd), str(self.log)],
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    pass_fds=(write_fd,),
                    start_new_session=True,
                )
        finally:
            os.close(write_fd)
        self.replies = _Replies(read_fd)

    def wait_ready(self, timeout: float = HOST_READY_TIMEOUT_S) -> bool:
        """Whether the host finished its imports (waits for it up to ``timeout`` s the first time)."""
        if self.ready is None:
            try:
                reply = self.replies.read(timeout)
            except EOFError:
                reply = None
            self.ready = reply is not None and "ready" in reply
            if not self.ready:
                logger.warning(
                    "engine host did not start; its jobs start fresh (log tail: %s)", log_tail(self.log, 600)
                )
                self.close()
        return self.ready

    def start(
        self, module: str, argv: Sequence[str], log: Path, env: Mapping[str, str]
    ) -> HostedProcess | None:
        """Fork ``python -m module argv...`` with ``env``, its output in ``log``; ``None`` when the host
        is busy with another job, not running, or did not start."""
        if not self.busy.acquire(blocking=False):
            return None
        try:
            if not self.wait_ready() or self.proc.poll() is not None:
                self.busy.release()
                return None
            request = {
                "module": module,
                "argv": list(argv),
                "log": str(log),
                "cwd": os.getcwd(),
                "env": dict(env),
            }
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            reply = self.replies.read(60.0)
        except (OSError, EOFError):
            reply = None
        if reply is None or "pid" not in reply:
            self.busy.release()
            self.close()
            return None
        return HostedProcess(self, int(reply["pid"]))

    def close(self) -> None:
        """End the host (it exits when its stdin closes) and remove its log. Safe to call again: the
        reply descriptor is closed once (a second close could hit a number reused since)."""
        if self.replies.fd < 0:
            return
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10.0)
        os.close(self.replies.fd)
        self.replies.fd, self.replies.closed = -1, True
        shutil.rmtree(self.dir, ignore_errors=True)


_HOSTS: dict[tuple[tuple[str, str], ...], list[EngineHost]] = {}
_HOSTS_LOCK = threading.Lock()


def _host_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k not in LATE_VARIABLES))


def engine_hosts(env: Mapping[str, str]) -> list[EngineHost]:
    """The warm hosts for ``env``, the first one started now (in the background) if there is none
    yet. Jobs of ``env`` differing only in :data:`~vllm_omni_mxfp4_tiny.engine_host.LATE_VARIABLES`
    share them."""
    key = _host_key(env)
    with _HOSTS_LOCK:
        hosts = _HOSTS.setdefault(key, [])
        if not hosts and _host_count() < MAX_HOSTS:
            hosts.append(EngineHost(dict(key)))
        return list(hosts)


def _another_host(env: Mapping[str, str]) -> EngineHost | None:
    """One more host for ``env`` (its others are busy), while fewer than :data:`MAX_HOSTS` run."""
    key = _host_key(env)
    with _HOSTS_LOCK:
        if _host_count() >= MAX_HOSTS:
            return None
        host = EngineHost(dict(key))
        _HOSTS.setdefault(key, []).append(host)
        return host


def _host_count() -> int:
    return sum(len(hosts) for hosts in _HOSTS.values())


def close_engine_hosts() -> None:
    """End every host this process started (also run when the process exits)."""
    with _HOSTS_LOCK:
        hosts = [host for group in _HOSTS.values() for host in group]
        _HOSTS.clear()
    for host in hosts:
        host.close()


atexit.register(close_engine_hosts)


def _start_hosted(args: Sequence[str], env: Mapping[str, str], log: Path) -> HostedProcess | None:
    if len(args) < 2 or args[0] != "-m" or args[1] not in HOSTED_MODULES:
        return None
    for host in engine_hosts(env):
        process = host.start(args[1], args[2:], log, env)
        if process is not None:
            return process
    host = _another_host(env)
    return None if host is None else host.start(args[1], args[2:], log, env)
