"""The error type of the checkpoint tools."""

from __future__ import annotations


class CheckpointError(ValueError):
    """An expected failure: bad input, a failed validation or a usage error.

    The message is one line that names the file or tensor at fault and says what was expected, so
    the CLI prints it without a traceback and exits with status 2.
    """
