"""The error type of the checkpoint tools, and the one JSON reader that raises it."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


class CheckpointError(ValueError):
    """An expected failure: bad input, a failed validation or a usage error.

    The message is one line that names the file or tensor at fault and says what was expected, so
    the CLI prints it without a traceback and exits with status 2.
    """


def require_regular_file(path: Path, blame: str | None = None) -> None:
    """Refuse ``path`` unless it is a regular file (symbolic links followed), without opening it.

    Opening a FIFO blocks and a device never ends, so every input file passes this first. ``blame``
    is what the message names as the fault (e.g. the index entry that points at ``path``); by
    default the path itself. A missing path passes: the caller reports it in its own words.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CheckpointError(f"{blame or path}: cannot stat {path} ({exc})") from None
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    if blame is None:
        raise CheckpointError(f"{path}: is {kind}, not a regular file; refusing to read it")
    raise CheckpointError(f"{blame} {path}, which is {kind}, not a regular file; refusing to read it")


def read_json_object(path: Path, *, if_missing: str, expected: str = "a JSON object") -> dict:
    """The JSON object in ``path``; a :class:`CheckpointError` naming the file otherwise.

    ``if_missing`` completes the message for a file that does not exist (what the file is needed
    for); ``expected`` describes the object when the file holds another JSON value.
    """
    require_regular_file(path)
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {if_missing}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected {expected}")
    return value
