"""``CpuOmniPlatform`` and the CPU attention backend, checked without starting an engine."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import psutil
import pytest
import torch
from omni_procs import omni_installed

from vllm_omni_mxfp4 import envs

DEVICES_ENV = envs.CPU_DEVICES.name
VISIBLE_DEVICES_ENV = envs.CPU_VISIBLE_DEVICES.name

pytestmark = [
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]


@pytest.fixture(scope="module")
def platform():
    from vllm_omni_mxfp4.platform import CpuOmniPlatform

    return CpuOmniPlatform()


@pytest.fixture
def clean_device_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEVICES_ENV, raising=False)
    monkeypatch.delenv(VISIBLE_DEVICES_ENV, raising=False)


def test_identity(platform) -> None:
    from vllm_omni.platforms.interface import OmniPlatform

    assert isinstance(platform, OmniPlatform)
    assert platform.is_out_of_tree()
    assert not (platform.is_cuda() or platform.is_rocm() or platform.is_npu() or platform.is_xpu())
    assert platform.is_cpu()  # vLLM-side checks (e.g. CPU linear kernels) see a CPU platform
    assert platform.device_type == "cpu" and platform.device_name == "cpu"
    assert platform.dist_backend == "gloo"
    assert platform.get_torch_device(0) == torch.device("cpu")
    assert platform.get_torch_device(3) == torch.device("cpu")
    assert platform.is_available()
    assert platform.get_device_version() is None
    assert platform.supports_torch_inductor() is False
    assert platform.supports_cpu_offload() is False


def test_the_class_path_vllm_omni_loads_is_the_public_class(platform) -> None:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from vllm_omni_mxfp4.platform import PLATFORM_CLASS

    assert resolve_obj_by_qualname(PLATFORM_CLASS) is type(platform)


def test_the_class_imports_first_in_a_fresh_process() -> None:
    """Importing the class before ``vllm_omni`` must not meet vLLM-Omni's platform resolution half-way."""
    from vllm_omni_mxfp4.platform import detected_accelerators

    code = (
        "from vllm_omni_mxfp4.platform import CpuOmniPlatform\n"
        "from vllm_omni.platforms import current_omni_platform\n"
        "print(CpuOmniPlatform.__name__, type(current_omni_platform) is CpuOmniPlatform)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != envs.CPU_PLATFORM.name}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["CpuOmniPlatform", str(not detected_accelerators())]


def test_device_calls_are_no_ops(platform) -> None:
    assert platform.set_device(torch.device("cpu")) is None
    assert platform.synchronize() is None
    assert platform.empty_cache() is None


def test_device_count_defaults_to_usable_cores(platform, clean_device_env: None) -> None:
    assert platform.get_device_count() == len(os.sched_getaffinity(0))


def test_device_count_from_env(platform, clean_device_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICES_ENV, "5")
    assert platform.get_device_count() == 5
    # vLLM-Omni's per-stage visibility list wins, as CUDA_VISIBLE_DEVICES does for CUDA.
    monkeypatch.setenv(VISIBLE_DEVICES_ENV, "0, 1")
    assert platform.get_device_count() == 2
    assert platform.device_control_env_var == VISIBLE_DEVICES_ENV


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_bad_device_count_is_a_clear_error(
    platform, clean_device_env: None, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(DEVICES_ENV, value)
    with pytest.raises(ValueError, match=DEVICES_ENV):
        platform.get_device_count()


def test_memory_queries_report_host_memory(platform) -> None:
    total = psutil.virtual_memory().total
    free, reported_total = platform.get_device_memory()
    assert reported_total == total
    assert 0 < free <= total
    assert 0 < platform.get_free_memory() <= total
    assert platform.get_device_total_memory(1) == total
    rss = psutil.Process().memory_info().rss
    assert 0.5 * rss < platform.memory_allocated() < 2 * rss


def test_peak_memory_follows_an_allocation_and_resets(platform) -> None:
    size = 256 << 20
    platform.reset_peak_memory_stats()
    before = platform.max_memory_allocated()
    block = torch.ones(size // 4, dtype=torch.float32)  # touched pages count in the resident set
    peak = platform.max_memory_allocated()
    assert peak - before >= 0.75 * size
    assert platform.max_memory_reserved() >= peak
    del block
    platform.reset_peak_memory_stats()
    assert platform.max_memory_allocated() < peak - 0.5 * size


def test_peak_stats_are_real_methods(platform) -> None:
    # vLLM's Platform.__getattr__ answers None for unknown names; the diffusion runner then failed
    # with "'NoneType' object is not callable" at reset_peak_memory_stats().
    for name in ("reset_peak_memory_stats", "max_memory_allocated", "max_memory_reserved", "memory_reserved"):
        assert callable(getattr(platform, name)), name


# --- attention ------------------------------------------------------------------------------------


@pytest.mark.parametrize("selected", [None, "TORCH_SDPA", "torch_sdpa", "SDPA"])
def test_attention_backend_is_cpu_sdpa(platform, selected: str | None) -> None:
    from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl
    from vllm_omni.diffusion.attention.selector import _load_backend_cls

    from vllm_omni_mxfp4.platform.attention import CpuSDPABackend, CpuSDPAImpl

    backend = _load_backend_cls(platform.get_diffusion_attn_backend_cls(selected, head_size=128))
    assert backend is CpuSDPABackend
    assert issubclass(backend, SDPABackend)
    assert backend.get_impl_cls() is CpuSDPAImpl and issubclass(CpuSDPAImpl, SDPAImpl)


@pytest.mark.parametrize("selected", ["FLASH_ATTN", "SAGE_ATTN", "CUDNN_ATTN"])
def test_other_attention_backends_are_refused(platform, selected: str) -> None:
    with pytest.raises(ValueError, match="TORCH_SDPA"):
        platform.get_diffusion_attn_backend_cls(selected, head_size=128)


def _reference_attention(q, k, v, scale, key_mask=None):
    """softmax(q k^T * scale) v per batch and head in float64; layout (B, S, H, D)."""
    q, k, v = (t.double() for t in (q, k, v))
    batch, sq, heads, _ = q.shape
    out = torch.zeros(batch, sq, heads, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            scores = q[b, :, h] @ k[b, :, h].T * scale
            if key_mask is not None:
                scores[:, ~key_mask[b]] = -math.inf
            out[b, :, h] = torch.softmax(scores, dim=-1) @ v[b, :, h]
    return out


def test_cpu_sdpa_matches_a_float64_reference() -> None:
    from vllm_omni.diffusion.attention.backends.abstract import AttentionMetadata

    from vllm_omni_mxfp4.platform.attention import CpuSDPAImpl

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, 3, 16, generator=gen)
    k = torch.randn(2, 5, 3, 16, generator=gen)
    v = torch.randn(2, 5, 3, 16, generator=gen)
    scale = 16**-0.5
    impl = CpuSDPAImpl(num_heads=3, head_size=16, softmax_scale=scale)

    out = impl.forward(q, k, v)
    assert out.shape == (2, 7, 3, 16)
    torch.testing.assert_close(out.double(), _reference_attention(q, k, v, scale), atol=1e-5, rtol=1e-5)

    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    masked = impl.forward(q, k, v, AttentionMetadata(attn_mask=mask))
    torch.testing.assert_close(
        masked.double(), _reference_attention(q, k, v, scale, mask), atol=1e-5, rtol=1e-5
    )
    assert not torch.allclose(masked[0], out[0])


def test_upstream_attention_dispatch_still_rejects_an_oot_platform(
    platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CpuSDPAImpl exists because AttentionImpl.forward has no branch for out-of-tree platforms.

    When this fails, vLLM-Omni dispatches OOT platforms itself and CpuSDPAImpl.forward can go.
    """
    import vllm_omni.diffusion.attention.backends.abstract as abstract
    from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl

    monkeypatch.setattr(abstract, "current_omni_platform", platform)
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(NotImplementedError, match="No forward implementation"):
        SDPAImpl(num_heads=2, head_size=8, softmax_scale=8**-0.5).forward(q, q, q)
