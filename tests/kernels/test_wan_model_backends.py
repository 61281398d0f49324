"""Model level: vLLM-Omni's tiny Wan2.2 transformer with every quantized Linear on a vendor kernel.

The model is built and loaded once per config by vLLM-Omni's own factory and loader (as in
tests/omni/test_wan_model.py); then every MXFP4 Linear is prepared by the NPU kernels (fake
torch_npu) or the ROCm kernel (fake AITER) and the whole forward must equal the same model on the
emulated kernels (float32 GEMMs; mirroring AITER's rule for ROCm). The tiny model's K (512, 1024)
and N need no padding, so the outputs are bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.layers import build_expert, exact, forward, offline_dirs, set_kernels
from vllm_omni_mxfp4.kernels import AiterSingle, EmulatedAiterSingle, NpuDual, NpuSingle
from vllm_omni_mxfp4.steps import denoise_step

from .conftest import install_aiter

pytestmark = pytest.mark.omni

__all__ = ["offline_dirs"]  # module fixtures

ONLINE = {
    "w4a8_layers": (
        {"method": "mxfp4", "w4a8_fallback_layers": ["blocks.0.attn1.to_qkv", "blocks.1.ffn.net_2"]},
        None,
    ),
    "dualscale_online": ({"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 1}, None),
}


def npu(fmt):
    return NpuSingle() if fmt == "mxfp4" else NpuDual()


def _forward(env, model, step):
    if step is None:
        return forward(env, model)
    with denoise_step(step):
        return forward(env, model)


@pytest.mark.parametrize("name", list(ONLINE))
def test_online_wan_expert_on_npu_kernels(vllm_env, tiny_dir, fake_npu, name):
    spec, step = ONLINE[name]
    model = build_expert(vllm_env, tiny_dir, {**spec, "backend": "emulated"})
    set_kernels(model, npu)
    out = _forward(vllm_env, model, step)
    assert any(
        op == ("npu_dual_level_quant_matmul" if "dual" in name else "npu_quant_matmul")
        for op, _, _ in fake_npu.calls
    )
    set_kernels(model, exact)
    assert torch.equal(out, _forward(vllm_env, model, step))


@pytest.mark.parametrize("method", ["mxfp4", "mxfp4_dualscale"])
def test_offline_wan_expert_on_npu_kernels(vllm_env, offline_dirs, fake_npu, method):
    model = build_expert(vllm_env, offline_dirs[method], None)
    set_kernels(model, npu)
    out = forward(vllm_env, model)
    set_kernels(model, exact)
    assert torch.equal(out, forward(vllm_env, model))


def test_offline_wan_expert_on_rocm_kernel(vllm_env, offline_dirs, monkeypatch):
    install_aiter(monkeypatch, "rceil")
    model = build_expert(vllm_env, offline_dirs["mxfp4"], None)  # with Smooth on some layers
    set_kernels(model, lambda fmt: AiterSingle())
    out = forward(vllm_env, model)
    set_kernels(model, lambda fmt: EmulatedAiterSingle(rule="rceil", compute_dtype="float32"))
    assert torch.equal(out, forward(vllm_env, model))
