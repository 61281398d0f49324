"""``CpuOmniPlatform``: vLLM-Omni's platform interface implemented for the host CPU.

This is the module :data:`~vllm_omni_mxfp4.platform.activation.PLATFORM_CLASS` names. Import the
class as ``vllm_omni_mxfp4.platform.CpuOmniPlatform``, which imports ``vllm_omni`` first (see the
package docstring for why that order matters).

It combines vLLM-Omni's ``OmniPlatform`` (the diffusion hooks) with vLLM's ``CpuPlatform`` (dtype
support, CPU linear kernels, ``gloo``), and fills in what the diffusion engine asks of a device:
a device and a device count, no-op device calls, memory figures from the host, peak-memory
statistics from the process' resident set, a CPU attention backend, and a model runner that
refuses requests too large for the host (:mod:`vllm_omni_mxfp4.platform.runner`). Whether it is used is
decided in :mod:`vllm_omni_mxfp4.platform.activation`; the device variables are read through
:mod:`vllm_omni_mxfp4.envs`.
"""

from __future__ import annotations

import logging
import os

import psutil
import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

from vllm_omni_mxfp4 import envs

from .request_guard import memory_limit

logger = logging.getLogger(__name__)

CPU_SDPA_BACKEND = "vllm_omni_mxfp4.platform.attention.CpuSDPABackend"
CPU_MODEL_RUNNER = "vllm_omni_mxfp4.platform.runner.CpuDiffusionModelRunner"

# Names under which users select torch SDPA for diffusion attention (vLLM-Omni's registry key is
# TORCH_SDPA; the backend itself reports SDPA).
_SDPA_NAMES = frozenset({"TORCH_SDPA", "SDPA"})

_PROC_STATUS = "/proc/self/status"
_PROC_CLEAR_REFS = "/proc/self/clear_refs"


def _usable_cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _resident_bytes() -> int:
    return psutil.Process().memory_info().rss


def _peak_resident_bytes() -> int:
    """Peak resident set of this process since start or the last reset (Linux VmHWM)."""
    try:
        with open(_PROC_STATUS) as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _resident_bytes()


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    """vLLM-Omni platform for machines without accelerators (an emulation/validation platform).

    Every tensor-parallel rank is a process on the host CPU; "devices" are virtual and all map to
    ``torch.device("cpu")``. Collective communication uses gloo.
    """

    _omni_enum = OmniPlatformEnum.OOT
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"
    device_control_env_var: str = envs.CPU_VISIBLE_DEVICES.name

    # -- devices ---------------------------------------------------------------------------------

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        """Virtual devices: the visible-device list if vLLM-Omni set one, else
        ``VLLM_OMNI_MXFP4_CPU_DEVICES``, else the number of CPU cores this process may use."""
        visible = envs.cpu_visible_devices()
        if visible:
            return len([d for d in visible.split(",") if d.strip()])
        configured = envs.cpu_devices()
        return configured if configured is not None else _usable_cpu_count()

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "cpu"

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        """No-op: every rank computes on the host CPU."""

    @classmethod
    def synchronize(cls) -> None:
        """No-op: CPU ops complete before they return."""

    @classmethod
    def empty_cache(cls) -> None:
        """No-op: there is no device caching allocator."""

    # -- memory ----------------------------------------------------------------------------------

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return psutil.virtual_memory().available

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        return psutil.virtual_memory().available, memory_limit().bytes

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        """The host's total memory, or the process' ``RLIMIT_AS`` where lower (the request limit)."""
        return memory_limit().bytes

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        return float(_resident_bytes())

    @classmethod
    def memory_allocated(cls, device: torch.device | int | None = None) -> int:
        """Resident memory of this process (the CPU has no tensor-only allocator statistics)."""
        return _resident_bytes()

    @classmethod
    def memory_reserved(cls, device: torch.device | int | None = None) -> int:
        return _resident_bytes()

    @classmethod
    def max_memory_allocated(cls, device: torch.device | int | None = None) -> int:
        """Peak resident memory of this process since the last :meth:`reset_peak_memory_stats`."""
        return _peak_resident_bytes()

    @classmethod
    def max_memory_reserved(cls, device: torch.device | int | None = None) -> int:
        return _peak_resident_bytes()

    @classmethod
    def reset_peak_memory_stats(cls, device: torch.device | int | None = None) -> None:
        """Reset the process' peak resident set (Linux ``clear_refs`` 5); a no-op where unsupported."""
        try:
            with open(_PROC_CLEAR_REFS, "w") as clear_refs:
                clear_refs.write("5")
        except OSError:
            logger.debug("Cannot reset the peak resident set on this system", exc_info=True)

    # -- capabilities ----------------------------------------------------------------------------

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def supports_cpu_offload(cls) -> bool:
        """Weights already live in host memory; offloading them to it is meaningless."""
        return False

    @classmethod
    def has_flash_attn_package(cls) -> bool:
        return False

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    @classmethod
    def get_diffusion_model_runner_cls(cls) -> str:
        """vLLM-Omni's runner plus the request guard: oversized requests fail alone, failures carry a reason."""
        return CPU_MODEL_RUNNER

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        raise NotImplementedError(
            "The vllm-omni-mxfp4 CPU platform runs diffusion stages only; autoregressive stages are not supported."
        )

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        raise NotImplementedError(
            "The vllm-omni-mxfp4 CPU platform runs diffusion stages only; generation stages are not supported."
        )

    @classmethod
    def get_diffusion_attn_backend_cls(
        cls,
        selected_backend: str | None,
        head_size: int,
        allow_trtllm_default: bool = False,
    ) -> str:
        """TORCH_SDPA (the CPU subclass of vLLM-Omni's SDPA backend) is the only backend here."""
        if selected_backend is not None and selected_backend.upper() not in _SDPA_NAMES:
            raise ValueError(
                f"Diffusion attention backend {selected_backend!r} is not available on the CPU platform "
                "(vllm-omni-mxfp4); select TORCH_SDPA or leave the backend unset."
            )
        return CPU_SDPA_BACKEND
