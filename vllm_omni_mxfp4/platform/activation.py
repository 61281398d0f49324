"""Whether this process runs vLLM-Omni on the CPU platform, and the two entry points that act on it.

vLLM-Omni asks every ``vllm_omni.platform_plugins`` entry point for a platform class path and
prefers an out-of-tree answer over its built-in platforms. So :func:`activate` must say ``None``
whenever a real accelerator is present, unless the user forces the CPU platform on. The rule,
from ``VLLM_OMNI_MXFP4_CPU_PLATFORM`` (read through :mod:`vllm_omni_mxfp4.envs`) and the
accelerator probes:

* ``auto``: active when no probe finds an accelerator;
* ``on``: active (a warning names any accelerator present);
* ``off`` or an invalid value: not active, and the probes are not run.

:func:`decide` computes that rule without side effects. :class:`Activator` adds the one log line
that says the platform is active; vLLM-Omni calls the entry point more than once per process, so
the line is written on the first active call only. ``activate`` is the process-wide activator.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from .. import envs
from .._logging import attach_to_vllm_logging
from .probes import ACCELERATOR_PROBES, Probe, detected_accelerators

logger = logging.getLogger(__name__)

PLATFORM_CLASS = "vllm_omni_mxfp4.platform._cpu_platform.CpuOmniPlatform"
"""The class path :func:`activate` returns; vLLM-Omni imports and instantiates it."""


@dataclass(frozen=True)
class Decision:
    """What activation concluded: the mode, the accelerators found, and the reason it is off.

    ``mode`` is ``"auto"``, ``"on"``, ``"off"`` or ``"invalid"`` (then ``error`` says why).
    """

    mode: str
    accelerators: tuple[str, ...] = ()
    error: str | None = None

    @property
    def active(self) -> bool:
        return self.mode == "on" or (self.mode == "auto" and not self.accelerators)


def decide(probes: Mapping[str, Probe] = ACCELERATOR_PROBES) -> Decision:
    """Apply the activation rule (module docstring) to the environment and ``probes``; no logging."""
    try:
        mode = envs.cpu_platform_mode()
    except ValueError as exc:
        return Decision("invalid", error=str(exc))
    if mode == "off":
        return Decision("off")
    return Decision(mode, tuple(detected_accelerators(probes)))


class Activator:
    """The ``vllm_omni.platform_plugins`` entry point as an object that remembers it has announced.

    Calling it returns :data:`PLATFORM_CLASS` when :func:`decide` says active, else ``None``. The
    first active call routes the package's logging to vLLM's handler and logs one line (INFO, or
    WARNING when forced on next to an accelerator); an invalid variable is logged as an error on
    every call, because vLLM-Omni swallows exceptions raised by platform plugins.
    """

    def __init__(self, probes: Mapping[str, Probe] = ACCELERATOR_PROBES) -> None:
        self.probes = probes
        self.announced = False

    def __call__(self) -> str | None:
        decision = decide(self.probes)
        if decision.error is not None:
            logger.error("%s; the CPU platform stays off.", decision.error)
            return None
        if not decision.active:
            logger.debug(
                "CPU platform not activated (%s): accelerator(s) %s", decision.mode, decision.accelerators
            )
            return None
        if not self.announced:
            self.announced = True
            attach_to_vllm_logging()
            _announce(decision)
        return PLATFORM_CLASS


def _announce(decision: Decision) -> None:
    if decision.accelerators:
        logger.warning(
            "vLLM-Omni CPU platform (vllm-omni-mxfp4) is active because %s forces it, although an "
            "accelerator is present (%s).",
            envs.CPU_PLATFORM.name,
            ", ".join(decision.accelerators),
        )
    else:
        logger.info(
            "vLLM-Omni CPU platform (vllm-omni-mxfp4) is active: no accelerator found; set %s=0 to disable.",
            envs.CPU_PLATFORM.name,
        )


_PROCESS_ACTIVATOR = Activator()


def activate() -> str | None:
    """Entry point of group ``vllm_omni.platform_plugins``: the CPU platform's class path, or ``None``."""
    return _PROCESS_ACTIVATOR()


def install_fixups() -> None:
    """Entry point of group ``vllm_omni.general_plugins``: the CPU runtime fix-ups, where the platform is active.

    vLLM-Omni calls general plugins in every process it starts (API server, engine, stage and
    worker processes) before it builds workers; see :mod:`vllm_omni_mxfp4.platform.fixups` (the
    worker output loop), :mod:`vllm_omni_mxfp4.platform.op_fixups` (three ops vLLM's CPU path lacks),
    :mod:`vllm_omni_mxfp4.platform.job_errors` (a failed job's reason, in the API server only),
    :mod:`vllm_omni_mxfp4.platform.warmup` (a small start-up warm-up request) and
    :mod:`vllm_omni_mxfp4.platform.device_hint` (how to run more ranks than cores, in the device-count
    error).
    """
    if not decide().active:
        return
    from .device_hint import install_device_hint
    from .fixups import install_worker_output_fixup
    from .job_errors import install_video_error_fixup
    from .op_fixups import install_op_fixups
    from .warmup import install_cpu_warmup_fixup

    install_worker_output_fixup()
    install_op_fixups()
    install_video_error_fixup()
    install_cpu_warmup_fixup()
    install_device_hint()
