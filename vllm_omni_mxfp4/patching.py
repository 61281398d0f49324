"""The one way this package changes vLLM and vLLM-Omni: each hooked attribute wrapped once, by one hook.

Every process loads the plugin, and tests load it again, so installing twice must leave one
wrapper. :func:`wrap_once` marks its wrappers and refuses to wrap an attribute that another hook of
this package already wrapped: each vLLM-Omni attribute has exactly one wrapper here, whose body
runs the steps that attribute needs in a fixed order (no wrapper stacking, no dependence on the
order hooks are installed in). :data:`WRAPPED` lists what was wrapped, for the docs and the tests;
:func:`original_of` gives back the upstream function behind a wrapper. The quantization hooks
(:mod:`vllm_omni_mxfp4.hooks`) and the CPU platform's fix-ups (:mod:`vllm_omni_mxfp4.platform`) both
install through it. Standard library only.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

MARKER = "_vllm_omni_mxfp4_hook"
"""Attribute set on every wrapper: the name of the hook that made it."""

WRAPPED: dict[str, str] = {}
"""``owner.attribute`` -> the hook that wrapped it, for every attribute wrapped in this process."""


def _label(owner: Any, name: str) -> str:
    module = getattr(owner, "__module__", None) if isinstance(owner, type) else None
    owner_name = getattr(owner, "__qualname__", None) if isinstance(owner, type) else owner.__name__
    return f"{module}.{owner_name}.{name}" if module else f"{owner_name}.{name}"


def wrap_once(owner: Any, name: str, make: Callable[[Callable], Callable], hook: str) -> bool:
    """Replace ``owner.name`` by ``make(original)`` (a new function each call: ``functools.wraps``-ed,
    keeping a docstring of its own, marked with ``hook``) unless it already is that hook's wrapper; returns whether it wrapped. A classmethod is wrapped
    as its function and stays a classmethod (``make`` gets the function, which takes ``cls``). Wrapping an
    attribute that another of this package's hooks wrapped is a programming error: one attribute,
    one hook."""
    raw = owner.__dict__.get(name) if isinstance(owner, type) else None
    is_classmethod = isinstance(raw, classmethod)
    current = raw.__func__ if is_classmethod else getattr(owner, name)
    marked = getattr(current, MARKER, None)
    if marked == hook:
        return False
    if marked is not None:
        raise RuntimeError(
            f"{_label(owner, name)} is already wrapped by hook {marked!r}; {hook!r} must join it"
        )
    wrapper = make(current)
    doc = wrapper.__doc__
    functools.update_wrapper(wrapper, current)
    if doc:  # a wrapper that documents itself (a replacement) keeps its own words
        wrapper.__doc__ = doc
    setattr(wrapper, MARKER, hook)
    setattr(owner, name, classmethod(wrapper) if is_classmethod else wrapper)
    WRAPPED[_label(owner, name)] = hook
    return True


def wrap_logged(owner: Any, name: str, make: Callable[[Callable], Callable], hook: str, what: str) -> bool:
    """:func:`wrap_once`, with one DEBUG line saying ``what`` changed when this call wrapped it."""
    wrapped = wrap_once(owner, name, make, hook)
    if wrapped:
        logger.debug("vllm-omni-mxfp4: %s (%s, hook %s)", what, _label(owner, name), hook)
    return wrapped


def original_of(function: Callable) -> Callable:
    """The upstream function behind one of :func:`wrap_once`'s wrappers (``function`` itself when it
    is not one)."""
    while getattr(function, MARKER, None) is not None:
        function = function.__wrapped__
    return function
