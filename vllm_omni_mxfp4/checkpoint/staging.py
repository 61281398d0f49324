"""Build an output directory beside its target and publish it with a rename.

The merge writes into ``.<target>.mxfp4-merge-staging.<host>.<pid>.<token>`` in the target's parent
(same filesystem, so the final ``os.rename`` is atomic) and renames it to the target only when
everything is written. A failure or an interruption the process sees (exception, SIGINT, SIGTERM)
removes the staging directory; a SIGKILL leaves it behind under its recognisable name, and the next
merge to the same target removes staging directories whose process on this host is gone. The target
therefore either does not exist or is complete. (With ``--overwrite`` the old target is renamed aside
just before the new one is renamed in; a SIGKILL between the two renames leaves no target, and the
next run removes both leftovers.)
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
from pathlib import Path

from .errors import CheckpointError

logger = logging.getLogger(__name__)

_MARK = "mxfp4-merge"


def _prefix(target: Path) -> str:
    return f".{target.name}.{_MARK}-"


def _host() -> str:
    return socket.gethostname().replace("/", "_") or "localhost"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sibling(target: Path, kind: str) -> Path:
    return target.parent / f"{_prefix(target)}{kind}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}"


def stale_dirs(target: Path) -> list[Path]:
    """Staging or replaced directories of ``target`` left by dead merge processes on this host."""
    prefix, host, stale = _prefix(target), _host(), []
    if not target.parent.is_dir():
        return stale
    for entry in target.parent.iterdir():
        if not entry.name.startswith(prefix) or not entry.is_dir() or entry.is_symlink():
            continue
        try:
            _kind, rest = entry.name[len(prefix) :].split(".", 1)
            owner, pid, _token = rest.rsplit(".", 2)
            dead = owner == host and not _pid_alive(int(pid))
        except ValueError:
            continue
        if dead:
            stale.append(entry)
    return sorted(stale)


def remove_stale(target: Path) -> list[Path]:
    """Remove what :func:`stale_dirs` finds; returns the removed paths."""
    removed = stale_dirs(target)
    for path in removed:
        logger.warning("removing %s, left by an interrupted merge", path)
        shutil.rmtree(path, ignore_errors=True)
    return removed


def create(target: Path) -> Path:
    """A fresh, empty staging directory beside ``target``."""
    path = _sibling(target, "staging")
    path.mkdir()
    return path


def discard(staging: Path) -> None:
    """Remove a staging directory (after a failure)."""
    shutil.rmtree(staging, ignore_errors=True)


def publish(staging: Path, target: Path, overwrite: bool) -> None:
    """Rename the finished ``staging`` directory to ``target``.

    With ``overwrite`` an existing target is first renamed aside and deleted after the new one is in
    place; without it an existing target is an error.
    """
    replaced = None
    if target.exists() or target.is_symlink():
        if not overwrite:
            raise CheckpointError(f"output path {target} exists; pass --overwrite to replace it")
        replaced = _sibling(target, "replaced")
        os.rename(target, replaced)
    os.rename(staging, target)
    if replaced is not None:
        if replaced.is_dir() and not replaced.is_symlink():
            shutil.rmtree(replaced, ignore_errors=True)
        else:
            replaced.unlink()
