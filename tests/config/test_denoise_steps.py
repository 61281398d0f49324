"""The denoising-step provider: our context manager and vLLM-Omni's forward context."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from vllm_omni_mxfp4.config import Mxfp4Config, Precision
from vllm_omni_mxfp4.steps import current_denoise_step, denoise_step


def test_no_step_published():
    assert current_denoise_step() is None


def test_context_manager_publishes_and_restores():
    with denoise_step(4):
        assert current_denoise_step() == 4
        with denoise_step(0):
            assert current_denoise_step() == 0
        assert current_denoise_step() == 4
    assert current_denoise_step() is None


def test_context_manager_restores_after_an_exception():
    with pytest.raises(KeyError), denoise_step(2):
        raise KeyError("boom")
    assert current_denoise_step() is None


@pytest.mark.parametrize("step", [-1, True, 1.0, "1", None])
def test_context_manager_rejects_bad_steps(step):
    with pytest.raises(ValueError, match="non-negative integer denoise step index"), denoise_step(step):
        pass


def test_steps_are_per_thread():
    seen = []
    with denoise_step(9):
        worker = threading.Thread(target=lambda: seen.append(current_denoise_step()))
        worker.start()
        worker.join()
    assert seen == [None]


def test_importing_config_and_steps_pulls_in_no_heavy_module():
    """The step lookup must not import vLLM-Omni (seconds, side effects) when it is not loaded."""
    code = (
        "import sys\n"
        "from vllm_omni_mxfp4.config import parse_quantization\n"
        "from vllm_omni_mxfp4.steps import current_denoise_step\n"
        "assert current_denoise_step() is None\n"
        "parse_quantization('mxfp4').route('blocks.0.attn1.to_qkv').precision_now()\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'vllm_omni', 'numpy'))\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------------
# vLLM-Omni's forward context, for real
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def forward_context():
    return pytest.importorskip("vllm_omni.diffusion.forward_context")


def test_reads_the_step_of_set_forward_context(forward_context):
    with forward_context.set_forward_context(denoise_step_idx=7):
        assert current_denoise_step() == 7
    assert current_denoise_step() is None


def test_reads_the_step_of_override_forward_context(forward_context):
    with forward_context.override_forward_context(forward_context.ForwardContext(denoise_step_idx=0)):
        assert current_denoise_step() == 0


def test_follows_steps_recorded_during_the_loop(forward_context):
    """Pipelines update the index in place at the top of every denoising iteration."""
    with forward_context.set_forward_context():
        assert current_denoise_step() is None
        seen = []
        for step in range(3):
            forward_context.set_forward_context_denoise_step_idx(step)
            seen.append(current_denoise_step())
        assert seen == [0, 1, 2]
        forward_context.DenoiseProgressMixin().record_denoise_step(11, total_steps=40)
        assert current_denoise_step() == 11


def test_our_step_takes_precedence(forward_context):
    with forward_context.set_forward_context(denoise_step_idx=7), denoise_step(2):
        assert current_denoise_step() == 2


def test_routing_follows_the_forward_context(forward_context):
    route = Mxfp4Config(w4a8_fallback_steps=[1]).route("blocks.4.ffn.net_2")
    with forward_context.set_forward_context(denoise_step_idx=1):
        assert route.precision_now() is Precision.W4A8
        forward_context.set_forward_context_denoise_step_idx(2)
        assert route.precision_now() is Precision.W4A4
    with (
        forward_context.set_forward_context(),
        pytest.raises(RuntimeError, match="no denoise step is published"),
    ):
        route.precision_now()
