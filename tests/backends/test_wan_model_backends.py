"""Model level: vLLM-Omni's tiny Wan2.2 transformer with every quantized Linear on a vendor backend.

The model is built and loaded once per config by vLLM-Omni's own factory and loader (as in
tests/omni/test_wan_model.py); then every MXFP4 Linear is prepared by the NPU backend (fake
torch_npu) or the ROCm backend (fake AITER) and the whole forward must equal the same model on the
emulated backend (float32 GEMMs; mirroring AITER's rule for ROCm). The tiny model's K (512, 1024)
and N need no padding, so the outputs are bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from tests.omni import test_wan_model as wan
from vllm_omni_mxfp4.backends import EmulatedBackend
from vllm_omni_mxfp4.steps import denoise_step

from .conftest import install_aiter

pytestmark = pytest.mark.omni

# The tiny model and its offline checkpoints, built once per module as in tests/omni.
tiny_dir = wan.tiny_dir
offline_dirs = wan.offline_dirs


def _forward(env, model, step):
    if step is None:
        return wan.forward(env, model)
    with denoise_step(step):
        return wan.forward(env, model)


@pytest.mark.parametrize("name", ["w4a8_layers", "dualscale_online"])
def test_online_wan_expert_on_npu_backend(vllm_env, tiny_dir, npu_backend, fake_npu, name):
    spec, step, _ = wan.ONLINE[name]
    model = wan.build_expert(vllm_env, tiny_dir, {**spec, "backend": "emulated"})
    wan.set_backend(model, npu_backend)
    out = _forward(vllm_env, model, step)
    assert any(
        op == ("npu_dual_level_quant_matmul" if "dual" in name else "npu_quant_matmul")
        for op, _, _ in fake_npu.calls
    )
    wan.set_backend(model, EmulatedBackend(compute_dtype="float32"))
    assert torch.equal(out, _forward(vllm_env, model, step))


@pytest.mark.parametrize("method", ["mxfp4", "mxfp4_dualscale"])
def test_offline_wan_expert_on_npu_backend(vllm_env, offline_dirs, npu_backend, method):
    model = wan.build_expert(vllm_env, offline_dirs[method], None)
    wan.set_backend(model, npu_backend)
    out = wan.forward(vllm_env, model)
    wan.set_backend(model, EmulatedBackend(compute_dtype="float32"))
    assert torch.equal(out, wan.forward(vllm_env, model))


def test_offline_wan_expert_on_rocm_backend(vllm_env, offline_dirs, monkeypatch):
    from vllm_omni_mxfp4.backends.rocm import RocmBackend

    install_aiter(monkeypatch, "rceil")
    rocm_backend = RocmBackend()
    model = wan.build_expert(vllm_env, offline_dirs["mxfp4"], None)  # with Smooth on some layers
    wan.set_backend(model, rocm_backend)
    out = wan.forward(vllm_env, model)
    wan.set_backend(model, EmulatedBackend(compute_dtype="float32", mirror="rocm:rceil"))
    assert torch.equal(out, wan.forward(vllm_env, model))
