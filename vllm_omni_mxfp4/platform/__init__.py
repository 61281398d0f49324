"""CPU platform for vLLM-Omni: run ``Omni(...)`` and ``vllm serve --omni`` on a machine without accelerators.

vLLM-Omni 0.30 ships CUDA, ROCm, NPU, XPU and MUSA platforms only. This package adds a CPU
*emulation platform* through vLLM-Omni's own extension points, so that a (quantized) diffusion
checkpoint can be validated through the real vLLM-Omni loading and serving code before it is
deployed on accelerators. It is not a performance path: no kernels are tuned, attention is
``torch.nn.functional.scaled_dot_product_attention``.

Enabling it
    Installing ``vllm-omni-mxfp4`` registers two entry points; nothing has to be imported:

    * ``vllm_omni.platform_plugins: cpu = vllm_omni_mxfp4.platform:activate`` chooses the platform;
    * ``vllm_omni.general_plugins: cpu_platform_fixups = vllm_omni_mxfp4.platform:install_fixups``
      installs the one runtime fix-up multi-process (TP>1) runs need, in every vLLM-Omni process.

    ``VLLM_OMNI_MXFP4_CPU_PLATFORM`` controls activation:

    * ``auto`` (default): active only when no accelerator platform applies, i.e. no CUDA or ROCm
      GPU, no Ascend NPU (``torch_npu`` importable *and* a device), no Intel XPU, no MUSA device,
      as seen both by torch and by vLLM-Omni's own built-in platform detectors. A machine with a
      real device is never taken over.
    * ``1`` / ``on`` / ``true`` / ``force``: always active, even next to an accelerator (a warning
      names the accelerator).
    * ``0`` / ``off`` / ``false``: never active.

    When active, one line is logged: ``vLLM-Omni CPU platform (vllm-omni-mxfp4) is active ...``.
    ``VLLM_PLUGINS`` (vLLM's plugin filter by entry-point name) must, if set, include ``cpu`` and
    ``cpu_platform_fixups``.

    ``VLLM_OMNI_MXFP4_CPU_DEVICES`` sets how many virtual "devices" the platform reports (default:
    the number of CPU cores this process may run on). Every tensor-parallel rank is one process
    on the host CPU, so ``tensor_parallel_size`` may be at most this number.
    ``VLLM_OMNI_MXFP4_CPU_VISIBLE_DEVICES`` is the platform's device-visibility variable: vLLM-Omni
    writes stage device lists into it (as it does ``CUDA_VISIBLE_DEVICES``); users need not set it.

torchvision caveat
    vLLM-Omni's ``Omni`` and its Wan2.2 pipelines import torchvision. For CPU torch 2.13 the package
    registries only carry CUDA builds of torchvision, whose C extension cannot load next to CPU
    torch, and ``import torchvision`` then fails with ``operator torchvision::nms does not exist``.
    The project's test environment installs a start-up hook (``scripts/torchvision_cpu_hook.py``, a
    ``.pth`` line made by ``scripts/env.sh``) that lets such a torchvision import without its C ops,
    which the Wan2.2 text-to-video path never calls. On a machine with a torchvision build that
    matches torch, no hook is needed. This platform neither needs nor installs the hook.

torchaudio caveat (``vllm serve --omni`` only)
    vLLM-Omni's OpenAI API server imports torchaudio at start-up
    (``entrypoints/openai/audio_utils_mixin.py``); ``Omni(...)`` does not. The registry's
    torchaudio 2.11 wheel is also a CUDA build; with the compiled libraries under
    ``torchaudio/lib/`` removed it imports as a pure-Python package (its documented "extension not
    found" mode), which is all the video endpoints need.

Tested: Wan2.2 text-to-video (one and two experts) in BF16, TP=1 and TP=2 over gloo, with and
without a plugin quantization method, through ``Omni(...)`` and ``vllm serve --omni``. Refused or
disabled here: autoregressive and generation stages (``NotImplementedError``), CPU offload (weights
already live in host memory), torch.compile/inductor, attention backends other than TORCH_SDPA.
Untested: sequence/CFG parallelism, LoRA, other pipelines.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable

from .._logging import attach_to_vllm_logging

logger = logging.getLogger(__name__)

PLATFORM_ENV = "VLLM_OMNI_MXFP4_CPU_PLATFORM"
"""``auto`` (default) | ``1``/``on``/``true`` (force) | ``0``/``off``/``false`` (never)."""

DEVICES_ENV = "VLLM_OMNI_MXFP4_CPU_DEVICES"
"""Number of virtual devices (tensor-parallel ranks) the CPU platform reports."""

VISIBLE_DEVICES_ENV = "VLLM_OMNI_MXFP4_CPU_VISIBLE_DEVICES"
"""The platform's device-control variable, written by vLLM-Omni per stage."""

PLATFORM_CLASS = "vllm_omni_mxfp4.platform._cpu_platform.CpuOmniPlatform"

_FORCE_ON = frozenset({"1", "on", "true", "force"})
_FORCE_OFF = frozenset({"0", "off", "false"})
_AUTO = frozenset({"", "auto"})

_announced = False


def _torch_cuda_device() -> bool:
    """CUDA or ROCm GPU visible to torch (device_count uses NVML/amdsmi, no CUDA context)."""
    import torch

    return torch.cuda.device_count() > 0


def _torch_npu_device() -> bool:
    """Ascend NPU: ``torch_npu`` importable and at least one device."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch
    import torch_npu  # noqa: F401

    return torch.npu.is_available() and torch.npu.device_count() > 0


def _torch_xpu_device() -> bool:
    """Intel XPU visible to torch."""
    import torch

    return hasattr(torch, "xpu") and torch.xpu.is_available() and torch.xpu.device_count() > 0


def _omni_builtin_platform() -> bool:
    """Any of vLLM-Omni's built-in platform detectors (pynvml, amdsmi, npu, xpu, musa) fires."""
    from vllm_omni.platforms import builtin_omni_platform_plugins

    for name, detect in builtin_omni_platform_plugins.items():
        try:
            if detect() is not None:
                logger.debug("vLLM-Omni built-in platform %r detected", name)
                return True
        except Exception:  # a broken detector means "not this platform", as upstream treats it
            logger.debug("vLLM-Omni built-in platform detector %r failed", name, exc_info=True)
    return False


ACCELERATOR_PROBES: dict[str, Callable[[], bool]] = {
    "cuda/rocm (torch)": _torch_cuda_device,
    "npu (torch_npu)": _torch_npu_device,
    "xpu (torch)": _torch_xpu_device,
    "vllm-omni built-in platform": _omni_builtin_platform,
}
"""Probes of accelerator presence; any True keeps the CPU platform off in ``auto`` mode."""


def detected_accelerators() -> list[str]:
    """Names of the probes in :data:`ACCELERATOR_PROBES` that find an accelerator."""
    found = []
    for name, probe in ACCELERATOR_PROBES.items():
        try:
            present = probe()
        except Exception:  # e.g. a driver library that is installed but cannot load
            logger.debug("Accelerator probe %r failed; treating as absent", name, exc_info=True)
            present = False
        if present:
            found.append(name)
    return found


def platform_mode() -> str:
    """The activation mode from ``VLLM_OMNI_MXFP4_CPU_PLATFORM``: ``"auto"``, ``"on"`` or ``"off"``.

    Raises ``ValueError`` naming the variable when its value is not one of the accepted spellings.
    """
    raw = os.environ.get(PLATFORM_ENV, "auto")
    value = raw.strip().lower()
    if value in _AUTO:
        return "auto"
    if value in _FORCE_ON:
        return "on"
    if value in _FORCE_OFF:
        return "off"
    raise ValueError(
        f"{PLATFORM_ENV}={raw!r} is not valid: expected 'auto', '1'/'on'/'true' (force) or '0'/'off'/'false'"
    )


def cpu_platform_selected() -> bool:
    """Whether this process should run vLLM-Omni on the CPU platform (no logging, no side effects)."""
    try:
        mode = platform_mode()
    except ValueError:
        return False
    if mode == "off":
        return False
    if mode == "on":
        return True
    return not detected_accelerators()


def activate() -> str | None:
    """Entry point of group ``vllm_omni.platform_plugins``.

    Returns the class path of :class:`~vllm_omni_mxfp4.platform.cpu_platform.CpuOmniPlatform` when
    the CPU platform applies (see the module docstring), else ``None``. vLLM-Omni prefers an
    activated out-of-tree platform over its built-in ones, so ``auto`` mode checks for every
    accelerator itself before answering.
    """
    global _announced
    try:
        mode = platform_mode()
    except ValueError as exc:
        # vLLM-Omni swallows exceptions raised by platform plugins; say it loudly instead.
        logger.error("%s; the CPU platform stays off.", exc)
        return None
    if mode == "off":
        return None
    accelerators = detected_accelerators()
    if mode == "auto" and accelerators:
        logger.debug("CPU platform not activated: accelerator(s) present: %s", accelerators)
        return None
    if not _announced:
        _announced = True
        attach_to_vllm_logging()
        if accelerators:
            logger.warning(
                "vLLM-Omni CPU platform (vllm-omni-mxfp4) is active because %s=%s, although an "
                "accelerator is present (%s).",
                PLATFORM_ENV,
                os.environ.get(PLATFORM_ENV),
                ", ".join(accelerators),
            )
        else:
            logger.info(
                "vLLM-Omni CPU platform (vllm-omni-mxfp4) is active: no accelerator found; "
                "set %s=0 to disable.",
                PLATFORM_ENV,
            )
    return PLATFORM_CLASS


def install_fixups() -> None:
    """Entry point of group ``vllm_omni.general_plugins``: CPU runtime fix-ups; no-op elsewhere.

    vLLM-Omni calls general plugins in every process it starts (engine, stage and worker
    processes), before it builds workers. See :mod:`vllm_omni_mxfp4.platform.fixups`.
    """
    if not cpu_platform_selected():
        return
    from vllm_omni_mxfp4.platform.fixups import install_worker_output_fixup

    install_worker_output_fixup()
