"""When the CPU platform activates: auto / forced / off, with accelerators simulated through probe tables."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys
import types
from collections.abc import Iterator
from importlib.metadata import entry_points

import pytest
import torch
from omni_procs import omni_installed

import vllm_omni_mxfp4.platform as plat
from vllm_omni_mxfp4 import envs
from vllm_omni_mxfp4.platform import probes as probes_module

CLASS_PATH = "vllm_omni_mxfp4.platform._cpu_platform.CpuOmniPlatform"
LOGGER = "vllm_omni_mxfp4.platform"
PLATFORM_ENV = envs.CPU_PLATFORM.name


def _probes(present: set[str]) -> dict:
    """Probes with the same names as the real ones; those in ``present`` report a device."""
    return {name: (lambda found=name in present: found) for name in plat.ACCELERATOR_PROBES}


@pytest.fixture
def caplog_platform(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Capture the platform's records at its own logger (activation may re-parent it under vLLM's)."""
    logger = logging.getLogger(LOGGER)
    monkeypatch.setattr(logger, "parent", logger.parent)
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.delenv(PLATFORM_ENV, raising=False)
    logger.addHandler(caplog.handler)
    yield
    logger.removeHandler(caplog.handler)


@pytest.fixture
def no_accelerator(monkeypatch: pytest.MonkeyPatch, caplog_platform: None) -> None:
    """The process-wide probe table reports no accelerator (for the entry points vLLM-Omni calls)."""
    for name in list(plat.ACCELERATOR_PROBES):
        monkeypatch.setitem(plat.ACCELERATOR_PROBES, name, lambda: False)


def _activator(present: set[str] = frozenset()) -> plat.Activator:
    return plat.Activator(_probes(set(present)))


def test_entry_points_are_registered() -> None:
    platform_eps = {ep.name: ep for ep in entry_points(group="vllm_omni.platform_plugins")}
    general_eps = {ep.name: ep for ep in entry_points(group="vllm_omni.general_plugins")}
    assert platform_eps["cpu"].value == "vllm_omni_mxfp4.platform:activate"
    assert general_eps["cpu_platform_fixups"].value == "vllm_omni_mxfp4.platform:install_fixups"
    assert platform_eps["cpu"].load() is plat.activate
    assert general_eps["cpu_platform_fixups"].load() is plat.install_fixups


def test_auto_without_accelerator_activates_and_logs_once(
    caplog_platform: None, caplog: pytest.LogCaptureFixture
) -> None:
    activator = _activator()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert activator() == CLASS_PATH
        assert activator() == CLASS_PATH  # vLLM-Omni calls it twice while resolving
    active_lines = [
        r for r in caplog.records if "CPU platform" in r.getMessage() and "active" in r.getMessage()
    ]
    assert len(active_lines) == 1
    assert active_lines[0].levelno == logging.INFO
    assert PLATFORM_ENV in active_lines[0].getMessage()  # says how to turn it off


def test_the_process_entry_point_follows_the_probe_table(no_accelerator: None) -> None:
    assert plat.activate() == CLASS_PATH
    plat.ACCELERATOR_PROBES["xpu (torch)"] = lambda: True  # restored by monkeypatch.setitem
    assert plat.activate() is None


@pytest.mark.parametrize("value", ["auto", "AUTO", " auto ", ""])
def test_auto_spellings(caplog_platform: None, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(PLATFORM_ENV, value)
    assert plat.decide(_probes(set())) == plat.Decision("auto")
    assert _activator()() == CLASS_PATH


@pytest.mark.parametrize("accelerator", list(plat.ACCELERATOR_PROBES))
def test_auto_never_hijacks_an_accelerator(
    caplog_platform: None, caplog: pytest.LogCaptureFixture, accelerator: str
) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert _activator({accelerator})() is None
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    decision = plat.decide(_probes({accelerator}))
    assert decision.accelerators == (accelerator,) and not decision.active


@pytest.mark.parametrize("value", ["1", "on", "ON", "true", "force"])
def test_forced_on_next_to_an_accelerator_warns(
    caplog_platform: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    monkeypatch.setenv(PLATFORM_ENV, value)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert _activator({"npu (torch_npu)"})() == CLASS_PATH
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "npu (torch_npu)" in warnings[0].getMessage() and PLATFORM_ENV in warnings[0].getMessage()
    assert plat.decide(_probes({"npu (torch_npu)"})).active


@pytest.mark.parametrize("value", ["0", "off", "OFF", "false"])
def test_off_never_activates(caplog_platform: None, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(PLATFORM_ENV, value)
    assert _activator()() is None
    assert plat.decide(_probes(set())) == plat.Decision("off")


def test_invalid_value_stays_off_with_a_clear_error(
    caplog_platform: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(PLATFORM_ENV, "maybe")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert _activator()() is None
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert PLATFORM_ENV in errors[0] and "'maybe'" in errors[0] and "stays off" in errors[0]
    decision = plat.decide(_probes(set()))
    assert decision.mode == "invalid" and not decision.active and PLATFORM_ENV in decision.error


def test_a_failing_probe_counts_as_absent(caplog_platform: None) -> None:
    def broken() -> bool:
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    probes = _probes(set())
    probes["cuda/rocm (torch)"] = broken
    assert plat.detected_accelerators(probes) == []
    assert plat.Activator(probes)() == CLASS_PATH


def test_off_does_not_probe(caplog_platform: None, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def probe() -> bool:
        calls.append(1)
        return False

    monkeypatch.setenv(PLATFORM_ENV, "off")
    assert plat.Activator({"cuda/rocm (torch)": probe})() is None
    assert calls == []


# --- the probes themselves, on simulated devices --------------------------------------------------


def test_cuda_probe_counts_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert probes_module.torch_cuda_device() is True
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert probes_module.torch_cuda_device() is False


def _fake_torch_npu(monkeypatch: pytest.MonkeyPatch, devices: int) -> None:
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    npu = types.SimpleNamespace(is_available=lambda: devices > 0, device_count=lambda: devices)
    monkeypatch.setattr(torch, "npu", npu, raising=False)


def test_npu_probe_needs_torch_npu_and_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_torch_npu(monkeypatch, devices=8)
    assert probes_module.torch_npu_device() is True
    _fake_torch_npu(monkeypatch, devices=0)
    assert probes_module.torch_npu_device() is False


def test_npu_probe_without_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    # Even a torch.npu left behind by something else is not enough without torch_npu.
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True), raising=False)
    assert probes_module.torch_npu_device() is False


def test_xpu_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 1)
    assert probes_module.torch_xpu_device() is True
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    assert probes_module.torch_xpu_device() is False


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="this machine has a GPU")
def test_real_probes_find_nothing_on_a_cpu_only_torch() -> None:
    assert probes_module.torch_cuda_device() is False
    assert probes_module.torch_xpu_device() is False
    assert probes_module.torch_npu_device() is False


def test_importing_the_package_imports_neither_torch_nor_vllm_omni() -> None:
    import subprocess

    code = (
        "import sys, vllm_omni_mxfp4.platform as p; p.decide; "
        "print(sorted(m for m in ('torch', 'vllm', 'vllm_omni') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


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
    assert probes_module.vllm_omni_builtin_platform() is False
    detectors["npu"] = lambda: "vllm_omni.platforms.npu.platform.NPUOmniPlatform"
    assert probes_module.vllm_omni_builtin_platform() is True


@pytest.mark.omni
@omni
def test_vllm_omni_resolution_picks_cpu_only_without_accelerator(no_accelerator: None) -> None:
    from vllm_omni.platforms import resolve_current_omni_platform_cls_qualname

    assert resolve_current_omni_platform_cls_qualname() == CLASS_PATH
    plat.ACCELERATOR_PROBES["cuda/rocm (torch)"] = lambda: True  # restored by monkeypatch.setitem
    assert resolve_current_omni_platform_cls_qualname() != CLASS_PATH


@pytest.mark.omni
@omni
def test_active_line_goes_through_vllm_logging(caplog_platform: None) -> None:
    import vllm.logger  # noqa: F401  (configures vLLM's handler)

    assert _activator()() == CLASS_PATH
    chain, log = [], logging.getLogger(LOGGER)
    while log is not None:
        chain.append(log.name)
        log = log.parent
    assert chain[:3] == ["vllm_omni_mxfp4.platform", "vllm_omni_mxfp4", "vllm"]
