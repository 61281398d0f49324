"""A warm process that forks engine jobs: vLLM-Omni is imported once, every job runs in a fresh fork.

    python -m vllm_omni_mxfp4_tiny.engine_host REPLY_FD HOST_LOG

On a CPU an engine job (:mod:`vllm_omni_mxfp4_tiny.engine_job`) spends ~12 s of its ~25 s importing
vLLM and vLLM-Omni, before any engine exists. The host pays that once: it imports what the job
imports (:data:`PRELOAD`), tells its client it is ready, and then, for every request, forks a child
that runs the job. A child starts where a fresh ``python -m`` process would be once its imports are
done: no engine has been built, no model loaded, no request run. It becomes the leader of a session
of its own (so the client reaps its whole process group as it reaps a command's), writes into the
job's log, and runs in the client's working directory with the client's environment. The job's log
starts with what the host's imports logged (the host's own output goes to ``HOST_LOG``), so it reads
as a fresh process' log would.

The client (:class:`vllm_omni_mxfp4_tiny.runner.EngineHost`) starts one host per environment and
sends only jobs whose environment equals the host's but for :data:`LATE_VARIABLES`, the variables
this package reads at each use rather than at import (:mod:`vllm_omni_mxfp4.envs`).

Protocol, one JSON object per line: requests on stdin ``{"module", "argv", "log", "cwd", "env"}``
(``module`` one of :data:`HOSTED_MODULES`, whose ``main(argv)`` returns the exit status); replies on
the file descriptor ``REPLY_FD``: ``{"ready": pid}`` once the imports are done, then for each
request ``{"pid": N}`` when the child runs and ``{"pid": N, "returncode": R}`` when it has exited.
One request runs at a time. The host exits when its stdin closes (its client ended).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from typing import IO, Any

#: What an engine job imports (engine_job imports them lazily), imported once by the host.
PRELOAD = (
    "numpy",
    "torch",
    "vllm_omni",
    "vllm_omni.inputs.data",
    "vllm_omni_mxfp4.inspection.engine",
)
#: The modules a host runs; each has ``main(argv: list[str]) -> int``.
HOSTED_MODULES = ("vllm_omni_mxfp4_tiny.engine_job",)
#: Environment variables that may differ between the host and a job: read at each use, never at
#: import (or, like the name of the running test that pytest sets, read by nothing a job imports).
LATE_VARIABLES = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "VLLM_OMNI_MXFP4_TRACE_FILE",
        "VLLM_OMNI_MXFP4_TRAJECTORY_DIR",
        "VLLM_OMNI_MXFP4_BACKEND",
        "VLLM_OMNI_MXFP4_EMULATED_MIRROR",
        "VLLM_OMNI_MXFP4_EMULATED_CACHE",
        "VLLM_OMNI_MXFP4_EMULATED_COMPUTE",
    }
)


def _exit_status(code: Any) -> int:
    """What ``sys.exit(code)`` makes the exit status."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _run_child(request: dict[str, Any], reply: IO[str], preamble: bytes) -> int:
    """In the forked child: become a session leader, take over the job's log, run the job.

    Returns the job's exit status, which the child's interpreter then exits with through its normal
    shutdown (threads joined, ``atexit`` handlers run, as a fresh process would).
    """
    try:
        os.setsid()
        reply.close()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(log, preamble)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        module = request["module"]
        if module not in HOSTED_MODULES:
            raise ValueError(f"engine host: {module!r} is not one of {HOSTED_MODULES}")
        sys.argv = [module, *request["argv"]]
        return _exit_status(importlib.import_module(module).main(list(request["argv"])))
    except SystemExit as exc:
        return _exit_status(exc.code)
    except BaseException:  # noqa: BLE001 - the child reports every failure as its exit status
        traceback.print_exc()
        return 1


def serve(reply_fd: int, host_log: str) -> int:
    """Import :data:`PRELOAD`, announce readiness, then fork one child per request until stdin closes.

    Returns 0 in the host, and in each forked child the child's exit status.
    """
    for name in (*PRELOAD, *HOSTED_MODULES):
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    with open(host_log, "rb") as f:
        preamble = f.read()
    reply = os.fdopen(reply_fd, "w", buffering=1)

    def send(message: dict[str, Any]) -> None:
        reply.write(json.dumps(message) + "\n")
        reply.flush()

    send({"ready": os.getpid()})
    while line := sys.stdin.readline():
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return _run_child(request, reply, preamble)
        send({"pid": pid})
        _, wait_status = os.waitpid(pid, 0)
        send({"pid": pid, "returncode": os.waitstatus_to_exitcode(wait_status)})
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_omni_mxfp4_tiny.engine_host REPLY_FD HOST_LOG``; returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[0].isdigit():
        print("usage: python -m vllm_omni_mxfp4_tiny.engine_host REPLY_FD HOST_LOG", file=sys.stderr)
        return 2
    return serve(int(args[0]), args[1])


if __name__ == "__main__":
    raise SystemExit(main())
