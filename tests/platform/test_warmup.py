"""The start-up warm-up cap (platform/warmup.py): the request upstream builds, at most the configured size."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from omni_procs import omni_installed

from vllm_omni_mxfp4.platform.warmup import HOOK, _capped, capped_size

UPSTREAM_SIZE = 512  # DiffusionEngine._dummy_run's height and width in vLLM-Omni 0.30


@pytest.mark.parametrize(
    "cap,expected",
    [(0, (512, 512)), (64, (64, 64)), (128, (128, 128)), (512, (512, 512)), (1024, (512, 512))],
)
def test_capped_size(cap: int, expected: tuple[int, int]) -> None:
    assert capped_size(UPSTREAM_SIZE, UPSTREAM_SIZE, cap) == expected
    assert capped_size(32, 48, 64) == (32, 48)  # never larger than what upstream asked for


def _recorded(monkeypatch: pytest.MonkeyPatch, value: str | None) -> dict[str, Any]:
    if value is None:
        monkeypatch.delenv("VLLM_OMNI_MXFP4_CPU_WARMUP_SIZE", raising=False)
    else:
        monkeypatch.setenv("VLLM_OMNI_MXFP4_CPU_WARMUP_SIZE", value)
    calls: list[dict[str, Any]] = []

    def upstream(self: Any, **kwargs: Any) -> str:
        calls.append({"self": self, **kwargs})
        return "request"

    engine = object()
    wrapped = _capped(upstream)
    assert wrapped(engine, height=512, width=512, guidance_scale=0.0, num_inference_steps=2) == "request"
    (call,) = calls
    assert call["self"] is engine and call["guidance_scale"] == 0.0 and call["num_inference_steps"] == 2
    return call


@pytest.mark.parametrize("value,size", [(None, 64), ("128", 128), ("0", 512)])
def test_the_wrapper_passes_the_capped_size_and_everything_else(
    monkeypatch: pytest.MonkeyPatch, value: str | None, size: int
) -> None:
    call = _recorded(monkeypatch, value)
    assert (call["height"], call["width"]) == (size, size)


def test_a_bad_size_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="VLLM_OMNI_MXFP4_CPU_WARMUP_SIZE='100'.*multiple of 16"):
        _recorded(monkeypatch, "100")


@pytest.mark.omni
@pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed")
def test_installed_on_the_engine_that_builds_the_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream still builds its warm-up through ``_make_dummy_request`` with keyword-only height and
    width (what the wrapper relies on), and the CPU platform's fix-ups wrap it with this hook."""
    import vllm_omni  # noqa: F401  (resolve the platform first)
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine

    from vllm_omni_mxfp4.patching import MARKER, original_of
    from vllm_omni_mxfp4.platform.activation import install_fixups

    monkeypatch.setattr(
        DiffusionEngine, "_make_dummy_request", DiffusionEngine.__dict__["_make_dummy_request"]
    )
    install_fixups()
    installed = DiffusionEngine.__dict__["_make_dummy_request"]
    assert getattr(installed, MARKER, None) == HOOK
    upstream = inspect.signature(original_of(installed)).parameters
    assert upstream["height"].kind is inspect.Parameter.KEYWORD_ONLY
    assert upstream["width"].kind is inspect.Parameter.KEYWORD_ONLY
    assert f"height={UPSTREAM_SIZE}" in inspect.getsource(original_of(DiffusionEngine._dummy_run))
