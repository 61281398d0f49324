"""Build an output directory beside its target and publish it with a rename.

The merge writes into ``.<target>.mxfp4-merge-staging.<host>.<pid>.<token>`` in the target's parent
(same filesystem, so the final ``os.rename`` is atomic) and renames it to the target only when
everything is written. Each staging directory is marked as the merge's own: its name has the owner's
host and pid, and an owner file inside (:data:`OWNER_FILE`) and an entry in a per-user registry
(``~/.cache/vllm-omni-mxfp4/merge-staging/``) record the owner's host, pid and process start time.

A failure or an interruption the process sees (an exception, SIGINT, SIGHUP, SIGQUIT, SIGTERM)
removes the staging directory. A SIGKILL cannot be caught: it leaves the staging directory behind,
and the next merge (to any target: it reads the registry and the target's parent) removes staging
directories whose owner is gone (no such pid on this host, or a pid reused by a process that started
later); ``--dry-run`` reports them. A directory is only removed when its name has the staging form,
it is a real directory, and its owner is provably gone. The target therefore either does not exist
or is complete. (With ``--overwrite`` the old target is renamed aside just before the new one is
renamed in; a SIGKILL between the two renames leaves no target, and the next run removes both
leftovers.)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
from pathlib import Path

from ..errors import CheckpointError

logger = logging.getLogger(__name__)

_MARK = "mxfp4-merge"
OWNER_FILE = ".mxfp4-merge-owner.json"
#: ``.<target>.mxfp4-merge-<kind>.<host>.<pid>.<token>``.
_NAME_RE = re.compile(
    rf"\.(?P<target>.+)\.{_MARK}-(?P<kind>staging|replaced)\.(?P<host>.+)\.(?P<pid>\d+)\.[0-9a-f]+"
)


def registry_dir() -> Path:
    """Where each live staging directory has an entry (one small JSON file), per user."""
    return Path.home() / ".cache" / "vllm-omni-mxfp4" / "merge-staging"


def _host() -> str:
    return socket.gethostname().replace("/", "_") or "localhost"


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (``/proc/<pid>/stat`` field 22), or ``None`` where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


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


def _owner_record() -> dict:
    return {"host": _host(), "pid": os.getpid(), "start": process_start(os.getpid())}


def owner_gone(owner: dict) -> bool:
    """Whether the merge process ``owner`` describes has exited (never true for another host)."""
    if owner.get("host") != _host() or not isinstance(owner.get("pid"), int):
        return False
    pid = owner["pid"]
    if not _pid_alive(pid):
        return True
    start = owner.get("start")
    return start is not None and process_start(pid) not in (None, start)


def _sibling(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}.{_MARK}-{kind}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}"


def _registry_entry(path: Path) -> Path:
    return registry_dir() / f"{path.name[1:]}.json"


def _register(path: Path, owner: dict) -> None:
    try:
        registry_dir().mkdir(parents=True, exist_ok=True)
        _registry_entry(path).write_text(json.dumps({**owner, "path": str(path)}))
    except OSError as exc:  # the parent-directory scan still finds it
        logger.warning("cannot record %s in %s (%s)", path, registry_dir(), exc)


def _unregister(path: Path) -> None:
    with contextlib.suppress(OSError):
        _registry_entry(path).unlink(missing_ok=True)


def _read_owner(path: Path) -> dict | None:
    """The owner of a staging directory: its owner file, else its registry entry, else its name."""
    for source in (path / OWNER_FILE, _registry_entry(path)):
        try:
            owner = json.loads(source.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(owner, dict):
            return owner
    match = _NAME_RE.fullmatch(path.name)
    return None if match is None else {"host": match["host"], "pid": int(match["pid"])}


def _registered_paths() -> list[Path]:
    paths = []
    try:
        entries = sorted(registry_dir().glob("*.json"))
    except OSError:
        return paths
    for entry in entries:
        try:
            path = Path(json.loads(entry.read_text())["path"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if path.is_absolute() and _NAME_RE.fullmatch(path.name):
            paths.append(path)
    return paths


def stale_dirs(target: Path) -> list[Path]:
    """Staging or replaced directories left by merge processes that are gone: those in the registry
    (any target) and those in ``target``'s parent directory."""
    candidates = set(_registered_paths())
    if target.parent.is_dir():
        candidates.update(p for p in target.parent.iterdir() if _NAME_RE.fullmatch(p.name))
    stale = []
    for path in sorted(candidates):
        if path.is_dir() and not path.is_symlink():
            owner = _read_owner(path)
            if owner is not None and owner_gone(owner):
                stale.append(path)
    return stale


def _prune_registry() -> None:
    """Drop registry entries whose directory is gone and whose owner is gone too (a live merge
    registers its staging directory just before creating it)."""
    for path in _registered_paths():
        if not path.exists() and not path.is_symlink():
            owner = _read_owner(path)
            if owner is not None and owner_gone(owner):
                _unregister(path)


def remove_stale(target: Path) -> list[Path]:
    """Remove what :func:`stale_dirs` finds (and prune the registry); returns the removed paths."""
    removed = stale_dirs(target)
    for path in removed:
        logger.warning("removing %s, left by an interrupted merge", path)
        shutil.rmtree(path, ignore_errors=True)
        _unregister(path)
    _prune_registry()
    return removed


def create(target: Path) -> Path:
    """A fresh staging directory beside ``target``, marked (owner file and registry) as this process's."""
    path = _sibling(target, "staging")
    owner = _owner_record()
    _register(path, owner)
    try:
        path.mkdir()
        (path / OWNER_FILE).write_text(json.dumps(owner))
    except BaseException:
        discard(path)
        raise
    return path


def discard(staging: Path) -> None:
    """Remove a staging directory (after a failure or an interruption).

    An interruption during the removal (a second Ctrl-C) does not stop it: the removal is finished
    first, then the interruption is raised.
    """
    pending: BaseException | None = None
    while True:
        try:
            shutil.rmtree(staging, ignore_errors=True)
            _unregister(staging)
            break
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the cleanup
            pending = exc
    if pending is not None:
        raise pending


def publish(staging: Path, target: Path, overwrite: bool) -> None:
    """Rename the finished ``staging`` directory to ``target``.

    With ``overwrite`` an existing target is first renamed aside and deleted after the new one is in
    place; without it an existing target is an error.
    """
    replaced = None
    (staging / OWNER_FILE).unlink()
    if target.exists() or target.is_symlink():
        if not overwrite:
            raise CheckpointError(f"output path {target} exists; pass --overwrite to replace it")
        replaced = _sibling(target, "replaced")
        _register(replaced, _owner_record())
        os.rename(target, replaced)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(replaced, target)  # put the old output back; the caller discards the staging
            _unregister(replaced)
            raise
    else:
        os.rename(staging, target)
    _unregister(staging)
    if replaced is not None:
        if replaced.is_dir() and not replaced.is_symlink():
            shutil.rmtree(replaced, ignore_errors=True)
        else:
            replaced.unlink()
        _unregister(replaced)
