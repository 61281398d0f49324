"""The one way this package wraps a vLLM-Omni function or method: once, marked, so that installing
twice (every process loads the plugin, tests load it again) leaves one wrapper."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def wrap_once(owner: Any, name: str, make: Callable[[Callable], Callable], marker: str) -> bool:
    """Replace ``owner.name`` by ``make(original)`` (``functools.wraps``-ed and marked with the
    attribute ``marker``) unless it already is such a wrapper; returns whether it wrapped."""
    original = getattr(owner, name)
    if getattr(original, marker, False):
        return False
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, marker, True)
    setattr(owner, name, wrapper)
    return True
