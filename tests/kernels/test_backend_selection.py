"""How a config's ``backend`` resolves to kernels: ``auto``, the override variable, the registry."""

from __future__ import annotations

import logging

import pytest

import vllm_omni_mxfp4.kernels as kernels
from vllm_omni_mxfp4.kernels import (
    KERNELS,
    EmulatedAiterSingle,
    EmulatedDual,
    EmulatedSingle,
    KernelSelector,
    MxLayerSpec,
    detect_backend,
)
from vllm_omni_mxfp4.kernels.npu import NpuKernel
from vllm_omni_mxfp4.kernels.rocm import AiterSingle
from vllm_omni_mxfp4.spec import BACKENDS, FORMATS


@pytest.fixture(autouse=True)
def fresh_announcements(monkeypatch):
    monkeypatch.setattr(kernels, "_announced", set())
    for name in ("VLLM_OMNI_MXFP4_BACKEND", "VLLM_OMNI_MXFP4_EMULATED_MIRROR"):
        monkeypatch.delenv(name, raising=False)


def spec(fmt="mxfp4", **kw):
    return MxLayerSpec(
        prefix="blocks.0.x", fmt=fmt, scale_rule="floor", in_features=64, out_features=32, **kw
    )


def test_auto_is_emulated_without_npu_or_rocm(caplog):
    name, why = detect_backend()
    assert name == "emulated"
    assert "torch_npu" in why and ("ROCm" in why or "rocm" in why)
    with caplog.at_level(logging.INFO, logger="vllm_omni_mxfp4"):
        selector = KernelSelector("auto")
        assert isinstance(selector.kernel_for(spec()), EmulatedSingle)
        assert isinstance(selector.kernel_for(spec("mxfp4_dualscale")), EmulatedDual)
        assert KernelSelector("auto").backend == "emulated"  # another config: no second line
    lines = [r.getMessage() for r in caplog.records if "MXFP4 backend" in r.getMessage()]
    assert lines == [f"vllm-omni-mxfp4: MXFP4 backend 'emulated' ({why})"]
    assert selector.kernel_for(spec()) is selector.kernel_for(spec())  # one kernel per config


@pytest.mark.parametrize(
    "npu,rocm,want", [(True, True, "npu"), (False, True, "rocm"), (False, False, "emulated")]
)
def test_auto_prefers_npu_then_rocm(monkeypatch, npu, rocm, want):
    monkeypatch.setattr(NpuKernel, "is_supported", classmethod(lambda cls: (npu, "npu probe")))
    monkeypatch.setattr(AiterSingle, "is_supported", classmethod(lambda cls: (rocm, "rocm probe")))
    assert detect_backend()[0] == want


def test_environment_variable_overrides_auto(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_OMNI_MXFP4_BACKEND", "emulated")
    monkeypatch.setattr(NpuKernel, "is_supported", classmethod(lambda cls: (True, "npu probe")))  # would win
    with caplog.at_level(logging.INFO, logger="vllm_omni_mxfp4"):
        assert KernelSelector("auto").backend == "emulated"
    assert any("VLLM_OMNI_MXFP4_BACKEND=emulated" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("VLLM_OMNI_MXFP4_BACKEND", "gpu")
    with pytest.raises(ValueError, match="VLLM_OMNI_MXFP4_BACKEND.*'gpu'"):
        KernelSelector("auto").kernel_for(spec())


def test_unknown_backend_name_is_an_error():
    with pytest.raises(ValueError, match="backend must be one of"):
        KernelSelector("cuda")


def test_the_registry_covers_every_format_and_backend():
    assert set(KERNELS) == {(fmt, backend) for fmt in FORMATS for backend in BACKENDS}
    for (fmt, backend), classes in KERNELS.items():
        assert all((cls.format, cls.backend) == (fmt, backend) for cls in classes)
    assert KERNELS["mxfp4_dualscale", "rocm"] == ()  # AITER has no dual-level GEMM


def test_emulated_mirror_selects_the_aiter_kernel_per_config(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_MXFP4_EMULATED_MIRROR", "rocm:aiter_legacy")
    selector = KernelSelector("emulated")
    kernel = selector.kernel_for(spec())
    assert isinstance(kernel, EmulatedAiterSingle) and kernel.rule == "aiter_legacy"
    with pytest.raises(
        NotImplementedError, match=r"blocks\.0\.x: mxfp4_dualscale is not supported.*rocm:aiter"
    ):
        selector.kernel_for(spec("mxfp4_dualscale"))
    with pytest.raises(NotImplementedError, match=r"W4A8 fallback.*ignored_layers"):
        selector.kernel_for(spec(w4a8=True))
    monkeypatch.setenv("VLLM_OMNI_MXFP4_EMULATED_MIRROR", "npu")  # read again by the next config
    assert isinstance(KernelSelector("emulated").kernel_for(spec()), EmulatedSingle)


def test_explicit_vendor_backends_name_what_is_missing():
    with pytest.raises(RuntimeError, match="MXFP4 backend 'npu' needs torch_npu"):
        KernelSelector("npu").kernel_for(spec())
    with pytest.raises(NotImplementedError, match=r"needs an AMD gfx950 GPU.*backend 'emulated'"):
        KernelSelector("rocm").kernel_for(spec("mxfp4_dualscale"))
