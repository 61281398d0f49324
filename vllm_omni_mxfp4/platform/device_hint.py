"""The way to run more ranks than CPU cores, in vLLM-Omni's "not enough devices" error on the CPU platform.

vLLM-Omni 0.30 checks a stage's device count against its parallel configuration before it starts a
worker (``vllm_omni.engine.stage_init_utils.build_diffusion_config`` and ``acquire_device_locks``)
and stops with "Stage 0 requires 4 device(s) based on parallel_config, but 2 device(s) are
available". On the CPU platform a device is a process on the host, and the count is what
``VLLM_OMNI_MXFP4_CPU_DEVICES`` says (default: the usable CPU cores), so the MXFP4 guide's
four-rank example cannot start on a two-core machine until that variable is set. The error names
neither. :func:`with_device_hint` re-raises that one error, with its type, adding the variable and
the value to set; every other error, and every call that succeeds, is upstream's. Both functions
are also imported by name into ``stage_engine_startup`` and ``stage_runtime``, so each of those
bindings is wrapped (:data:`SITES`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from ..patching import wrap_once

logger = logging.getLogger(__name__)

HOOK = "cpu_device_hint"

_NEEDED = re.compile(r"requires (\d+) device\(s\) based on parallel_config")

SITES = (
    ("vllm_omni.engine.stage_init_utils", "build_diffusion_config"),
    ("vllm_omni.engine.stage_init_utils", "acquire_device_locks"),
    ("vllm_omni.engine.stage_engine_startup", "build_diffusion_config"),
    ("vllm_omni.engine.stage_engine_startup", "acquire_device_locks"),
    ("vllm_omni.engine.stage_runtime", "acquire_device_locks"),
)
"""(module, function) bindings of vLLM-Omni's device-count checks."""


def device_hint(message: str) -> str | None:
    """What to add to vLLM-Omni's device-count error ``message`` on the CPU platform, or ``None``
    when ``message`` is another error."""
    match = _NEEDED.search(message)
    if match is None:
        return None
    needed = int(match.group(1))
    return (
        f"On the CPU platform (vllm-omni-mxfp4) each rank is a process on the host CPU and the platform "
        f"reports VLLM_OMNI_MXFP4_CPU_DEVICES devices (default: the CPU cores this process may use): "
        f"set VLLM_OMNI_MXFP4_CPU_DEVICES={needed} to run {needed} ranks on this machine (they share its "
        f"cores; nothing else changes)."
    )


def with_device_hint(upstream: Callable[..., Any]) -> Callable[..., Any]:
    """``upstream`` with :func:`device_hint` added to its device-count error."""

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return upstream(*args, **kwargs)
        except (RuntimeError, ValueError) as exc:
            hint = device_hint(str(exc))
            if hint is None:
                raise
            raise type(exc)(f"{exc}. {hint}") from exc

    return call


def install_device_hint() -> list[str]:
    """Wrap every binding of :data:`SITES` that the installed vLLM-Omni has; idempotent. Returns the
    bindings this call wrapped."""
    import importlib

    installed = []
    for module_name, name in SITES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a vLLM-Omni without that module has nothing to wrap there
            continue
        if hasattr(module, name) and wrap_once(module, name, with_device_hint, HOOK):
            installed.append(f"{module_name}.{name}")
    for site in installed:
        logger.debug("CPU platform: %s names VLLM_OMNI_MXFP4_CPU_DEVICES in its device-count error", site)
    return installed
