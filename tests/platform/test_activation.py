"""When the CPU platform activates: auto / forced / off, with accelerators simulated through the probes."""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types
from collections.abc import Iterator
from importlib.metadata import entry_points

import pytest
import torch
from omni_procs import omni_installed

import vllm_omni_mxfp4.platform as plat

CLASS_PATH = "vllm_omni_mxfp4.platform._cpu_platform.CpuOmniPlatform"
LOGGER = "vllm_omni_mxfp4.platform"


def _probes(present: set[str]) -> dict:
    """Probes with the same names as the real ones; those in ``present`` report a device."""
    return {name: (lambda found=name in present: found) for name in plat.ACCELERATOR_PROBES}


@pytest.fixture
def no_accelerator(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    monkeypatch.setattr(plat, "ACCELERATOR_PROBES", _probes(set()))
    monkeypatch.setattr(plat, "_announced", False)
    monkeypatch.delenv(plat.PLATFORM_ENV, raising=False)
    # activate() may route the package logger to vLLM's handler; capture at the logger itself.
    monkeypatch.setattr(plat.logger, "parent", plat.logger.parent)
    monkeypatch.setattr(plat.logger, "propagate", False)
    plat.logger.addHandler(caplog.handler)
    yield
    plat.logger.removeHandler(caplog.handler)


def test_entry_points_are_registered() -> None:
    platform_eps = {ep.name: ep.value for ep in entry_points(group="vllm_omni.platform_plugins")}
    general_eps = {ep.name: ep.value for ep in entry_points(group="vllm_omni.general_plugins")}
    assert platform_eps.get("cpu") == "vllm_omni_mxfp4.platform:activate"
    assert general_eps.get("cpu_platform_fixups") == "vllm_omni_mxfp4.platform:install_fixups"


def test_auto_without_accelerator_activates_and_logs_once(
    no_accelerator: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert plat.activate() == CLASS_PATH
        assert plat.activate() == CLASS_PATH  # vLLM-Omni calls it twice while resolving
    active_lines = [
        r for r in caplog.records if "CPU platform" in r.getMessage() and "active" in r.getMessage()
    ]
    assert len(active_lines) == 1
    assert active_lines[0].levelno == logging.INFO


@pytest.mark.parametrize("value", ["auto", "AUTO", " auto ", ""])
def test_auto_spellings(no_accelerator: None, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(plat.PLATFORM_ENV, value)
    assert plat.activate() == CLASS_PATH


@pytest.mark.parametrize("accelerator", list(plat.ACCELERATOR_PROBES))
def test_auto_never_hijacks_an_accelerator(
    no_accelerator: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, accelerator: str
) -> None:
    monkeypatch.setattr(plat, "ACCELERATOR_PROBES", _probes({accelerator}))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert plat.activate() is None
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    assert plat.cpu_platform_selected() is False


@pytest.mark.parametrize("value", ["1", "on", "ON", "true", "force"])
def test_forced_on_next_to_an_accelerator_warns(
    no_accelerator: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    monkeypatch.setattr(plat, "ACCELERATOR_PROBES", _probes({"npu (torch_npu)"}))
    monkeypatch.setenv(plat.PLATFORM_ENV, value)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert plat.activate() == CLASS_PATH
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "npu (torch_npu)" in warnings[0].getMessage()
    assert plat.cpu_platform_selected() is True


@pytest.mark.parametrize("value", ["0", "off", "OFF", "false"])
def test_off_never_activates(no_accelerator: None, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(plat.PLATFORM_ENV, value)
    assert plat.activate() is None
    assert plat.cpu_platform_selected() is False


def test_invalid_value_stays_off_with_a_clear_error(
    no_accelerator: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(plat.PLATFORM_ENV, "maybe")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert plat.activate() is None
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert plat.PLATFORM_ENV in errors[0] and "'maybe'" in errors[0]
    with pytest.raises(ValueError, match=plat.PLATFORM_ENV):
        plat.platform_mode()


def test_a_failing_probe_counts_as_absent(no_accelerator: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> bool:
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    probes = _probes(set())
    probes["cuda/rocm (torch)"] = broken
    monkeypatch.setattr(plat, "ACCELERATOR_PROBES", probes)
    assert plat.detected_accelerators() == []
    assert plat.activate() == CLASS_PATH


def test_off_does_not_probe(no_accelerator: None, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def probe() -> bool:
        calls.append(1)
        return False

    monkeypatch.setattr(plat, "ACCELERATOR_PROBES", {"cuda/rocm (torch)": probe})
    monkeypatch.setenv(plat.PLATFORM_ENV, "off")
    assert plat.activate() is None
    assert calls == []


# --- the probes themselves, on simulated devices --------------------------------------------------


def test_cuda_probe_counts_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert plat._torch_cuda_device() is True
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert plat._torch_cuda_device() is False


def _fake_torch_npu(monkeypatch: pytest.MonkeyPatch, devices: int) -> None:
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    npu = types.SimpleNamespace(is_available=lambda: devices > 0, device_count=lambda: devices)
    monkeypatch.setattr(torch, "npu", npu, raising=False)


def test_npu_probe_needs_torch_npu_and_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_torch_npu(monkeypatch, devices=8)
    assert plat._torch_npu_device() is True
    _fake_torch_npu(monkeypatch, devices=0)
    assert plat._torch_npu_device() is False


def test_npu_probe_without_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(plat.importlib.util, "find_spec", lambda name: None)
    # Even a torch.npu left behind by something else is not enough without torch_npu.
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True), raising=False)
    assert plat._torch_npu_device() is False


def test_xpu_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 1)
    assert plat._torch_xpu_device() is True
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    assert plat._torch_xpu_device() is False


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="this machine has a GPU")
def test_real_probes_find_nothing_on_a_cpu_only_torch() -> None:
    assert plat._torch_cuda_device() is False
    assert plat._torch_xpu_device() is False
    assert plat._torch_npu_device() is False


# --- through vLLM-Omni's own platform resolution --------------------------------------------------

omni = pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed")


@pytest.mark.omni
@omni
def test_builtin_detectors_are_consulted(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_omni.platforms as omni_platforms

    def raising() -> str:
        raise RuntimeError("amdsmi not initialised")

    detectors = {"cuda": lambda: None, "rocm": raising}
    monkeypatch.setattr(omni_platforms, "builtin_omni_platform_plugins", detectors)
    assert plat._omni_builtin_platform() is False
    detectors["npu"] = lambda: "vllm_omni.platforms.npu.platform.NPUOmniPlatform"
    assert plat._omni_builtin_platform() is True


@pytest.mark.omni
@omni
def test_vllm_omni_resolution_picks_cpu_only_without_accelerator(
    no_accelerator: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_omni.platforms import resolve_current_omni_platform_cls_qualname

    assert resolve_current_omni_platform_cls_qualname() == CLASS_PATH
    monkeypatch.setattr(plat, "ACCELERATOR_PROBES", _probes({"cuda/rocm (torch)"}))
    assert resolve_current_omni_platform_cls_qualname() != CLASS_PATH


@pytest.mark.omni
@omni
def test_active_line_goes_through_vllm_logging(no_accelerator: None) -> None:
    import vllm.logger  # noqa: F401  (configures vLLM's handler)

    assert plat.activate() == CLASS_PATH
    chain, log = [], plat.logger
    while log is not None:
        chain.append(log.name)
        log = log.parent
    assert chain[:3] == ["vllm_omni_mxfp4.platform", "vllm_omni_mxfp4", "vllm"]
