"""The error type of the checkpoint tools, and the one JSON reader that raises it."""

from __future__ import annotations

import json
from pathlib import Path


class CheckpointError(ValueError):
    """An expected failure: bad input, a failed validation or a usage error.

    The message is one line that names the file or tensor at fault and says what was expected, so
    the CLI prints it without a traceback and exits with status 2.
    """


def read_json_object(path: Path, *, if_missing: str, expected: str = "a JSON object") -> dict:
    """The JSON object in ``path``; a :class:`CheckpointError` naming the file otherwise.

    ``if_missing`` completes the message for a file that does not exist (what the file is needed
    for); ``expected`` describes the object when the file holds another JSON value.
    """
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {if_missing}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected {expected}")
    return value
