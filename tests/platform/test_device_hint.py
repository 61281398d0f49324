"""The CPU platform's device-count hint (platform/device_hint.py): vLLM-Omni's "not enough devices"
error names VLLM_OMNI_MXFP4_CPU_DEVICES and the value to set; other errors and results are upstream's."""

from __future__ import annotations

import pytest
from omni_procs import omni_installed

pytestmark = [
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]

# vLLM-Omni 0.30's two wordings (stage_init_utils.build_diffusion_config / acquire_device_locks)
UPSTREAM = (
    (
        ValueError,
        "Stage 0 requires 4 device(s) based on parallel_config, but 2 device(s) are available: [0, 1]",
    ),
    (
        RuntimeError,
        "Stage 1 requires 8 device(s) based on parallel_config, but only 2 device(s) are available: [0, 1]",
    ),
)


@pytest.mark.parametrize(("kind", "message"), UPSTREAM)
def test_the_device_count_error_names_the_variable_and_value(kind: type[Exception], message: str) -> None:
    from vllm_omni_mxfp4.platform.device_hint import with_device_hint

    def upstream(*args, **kwargs):
        raise kind(message)

    needed = message.split("requires ")[1].split(" ")[0]
    with pytest.raises(kind) as raised:
        with_device_hint(upstream)("model", stage=0)
    text = str(raised.value)
    assert text.startswith(message) and f"VLLM_OMNI_MXFP4_CPU_DEVICES={needed}" in text
    assert isinstance(raised.value.__cause__, kind)


def test_other_errors_and_results_are_upstreams() -> None:
    from vllm_omni_mxfp4.platform.device_hint import with_device_hint

    def failing():
        raise ValueError("HSDP (FSDP2) is not compatible with TP")

    with pytest.raises(ValueError) as raised:
        with_device_hint(failing)()
    assert str(raised.value) == "HSDP (FSDP2) is not compatible with TP" and raised.value.__cause__ is None
    assert with_device_hint(lambda a, b=1: (a, b))(3, b=4) == (3, 4)


def test_install_wraps_every_binding_once() -> None:
    import importlib

    from vllm_omni_mxfp4.patching import MARKER
    from vllm_omni_mxfp4.platform.device_hint import HOOK, SITES, install_device_hint

    install_device_hint()
    for module, name in SITES:  # every binding of the installed vLLM-Omni exists and is wrapped
        assert getattr(getattr(importlib.import_module(module), name), MARKER, None) == HOOK, (module, name)
    assert install_device_hint() == []
