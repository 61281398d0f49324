"""How ``backend: auto`` resolves, and the one log line that says which backend and why."""

from __future__ import annotations

import logging

import pytest

import vllm_omni_mxfp4.backends as backends
from vllm_omni_mxfp4.backends import EmulatedBackend, detect_backend, get_backend


@pytest.fixture(autouse=True)
def fresh_cache():
    get_backend.cache_clear()
    yield
    get_backend.cache_clear()


def test_auto_is_emulated_without_npu_or_rocm(caplog):
    name, why = detect_backend()
    assert name == "emulated"
    assert "torch_npu" in why and ("ROCm" in why or "rocm" in why)
    with caplog.at_level(logging.INFO, logger="vllm_omni_mxfp4"):
        backend = get_backend("auto")
    assert isinstance(backend, EmulatedBackend)
    lines = [r.getMessage() for r in caplog.records if "MXFP4 backend" in r.getMessage()]
    assert lines == [f"vllm-omni-mxfp4: MXFP4 backend 'emulated' ({why})"]
    assert get_backend("auto") is backend  # one instance (and one log line) per process


@pytest.mark.parametrize(
    "npu,rocm,want", [(True, True, "npu"), (False, True, "rocm"), (False, False, "emulated")]
)
def test_auto_prefers_npu_then_rocm(monkeypatch, npu, rocm, want):
    monkeypatch.setattr(backends, "_npu_status", lambda: (npu, "npu probe"))
    monkeypatch.setattr(backends, "_rocm_status", lambda: (rocm, "rocm probe"))
    assert detect_backend()[0] == want


def test_environment_variable_overrides_auto(monkeypatch, caplog):
    monkeypatch.setenv(backends.BACKEND_ENV, "emulated")
    monkeypatch.setattr(backends, "_npu_status", lambda: (True, "npu probe"))  # would win otherwise
    with caplog.at_level(logging.INFO, logger="vllm_omni_mxfp4"):
        assert isinstance(get_backend("auto"), EmulatedBackend)
    assert any("VLLM_OMNI_MXFP4_BACKEND=emulated" in r.getMessage() for r in caplog.records)
    get_backend.cache_clear()
    monkeypatch.setenv(backends.BACKEND_ENV, "gpu")
    with pytest.raises(ValueError, match="VLLM_OMNI_MXFP4_BACKEND must be one of"):
        get_backend("auto")


def test_unknown_backend_name_is_an_error():
    with pytest.raises(ValueError, match="backend must be one of"):
        get_backend("cuda")
