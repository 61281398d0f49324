"""How the ROCm kernel calls AITER: shuffles, layouts, the GEMM signature and the custom op.

Every assertion on the fake's call log or the kernel's prepared layouts lives here; the behavioural
comparisons with the emulated mirror are in ``test_rocm_backend.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.fake_aiter import FakeAiterError, shuffle_scale_layout
from tests.support.layers import K, N, build, run, weights
from vllm_omni_mxfp4.config import Precision
from vllm_omni_mxfp4.formats import quantize_mx
from vllm_omni_mxfp4.kernels import AiterSingle, EmulatedAiterSingle, MxLayerSpec

from .conftest import install_aiter

pytestmark = pytest.mark.omni

SPEC = MxLayerSpec("p", "mxfp4", "floor", K, N)


def _prepared(plain_layer, kernel, k=K, n=N, seed=47):
    w, b, x = weights(seed, n=n, k=k)
    data, scale = quantize_mx(w)
    layer = plain_layer({"weight": data, "weight_scale": scale})
    spec = MxLayerSpec("p", "mxfp4", "floor", k, n)
    return layer, kernel.prepare(layer, spec, None), x.reshape(-1, k), b, data


def test_weight_storage_is_adopted_and_tiles_padded(fake_aiter, plain_layer):
    layer, prepared, _, _, data = _prepared(plain_layer, AiterSingle())
    assert not torch.equal(layer.weight.data, data)  # the parameter holds AITER's shuffled bytes
    assert prepared.weight.is_shuffled
    layer, prepared, _, _, data = _prepared(plain_layer, AiterSingle(), k=80, n=40)
    assert prepared.weight.shape == (48, 64)  # (roundup(N, 16), roundup(K, 64) / 2)
    assert torch.equal(layer.weight.data, data)  # other shape: not adopted


def test_older_gemm_signature_gets_a_preallocated_output(vllm_env, monkeypatch):
    fake = install_aiter(monkeypatch, "aiter_legacy", gemm_api="out")
    w, b, x = weights(44)
    run(vllm_env, build(vllm_env, {"method": "mxfp4", "backend": "rocm"}, {"weight": w}, bias=b), x)
    _, gemm_args, _ = [c for c in fake.calls if c[0] == "gemm_a4w4"][-1]
    assert len(gemm_args) == 5 and gemm_args[4].dtype == torch.bfloat16  # (A, B, A_scale, B_scale, out)


def test_torch_compile_traces_around_the_custom_op(fake_aiter, plain_layer):
    kernel = AiterSingle()
    layer, prepared, x2, b, _ = _prepared(plain_layer, kernel, seed=45)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(
        lambda t: kernel.apply(layer, prepared, t, b, Precision.W4A4), backend=counting, fullgraph=True
    )
    assert torch.equal(compiled(x2), kernel.apply(layer, prepared, x2, b, Precision.W4A4))
    targets = {str(node.target) for node in graphs[0].graph.nodes}
    assert any("rocm_mxfp4_gemm" in t for t in targets), targets
    # The fake implementation agrees with the real one on what compile needs: shape, dtype, device.
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = (x2.contiguous(), prepared.weight, prepared.scale)
    real = torch.ops.vllm_omni_mxfp4.rocm_mxfp4_gemm(*args, N)
    with FakeTensorMode() as mode:
        fake = torch.ops.vllm_omni_mxfp4.rocm_mxfp4_gemm(*(mode.from_tensor(a) for a in args), N)
    assert (fake.shape, fake.dtype, fake.device) == (real.shape, real.dtype, real.device)


def test_a_missing_weight_shuffle_is_caught(fake_aiter, plain_layer):
    kernel = AiterSingle()
    kernel.shuffle_weight = lambda w, layout: w
    layer, prepared, x2, b, _ = _prepared(plain_layer, kernel)
    with pytest.raises(FakeAiterError, match="shuffle_weight"):
        kernel.apply(layer, prepared, x2, b, Precision.W4A4)


def test_unshuffled_weight_scales_give_wrong_numbers(fake_aiter, plain_layer):
    """Scales padded to AITER's shape but not permuted pass every shape check, and are still caught."""
    kernel = AiterSingle()
    kernel.e8m0_shuffle = lambda s: F.pad(
        s.view(torch.uint8), (0, 8 - s.shape[1] % 8 if s.shape[1] % 8 else 0, 0, -s.shape[0] % 256)
    ).view(s.dtype)
    layer, prepared, x2, b, _ = _prepared(plain_layer, kernel, seed=48)
    mirror = EmulatedAiterSingle(rule=fake_aiter.rule, compute_dtype="float32")
    m_layer, m_prepared, _, _, _ = _prepared(plain_layer, mirror, seed=48)
    want = mirror.apply(m_layer, m_prepared, x2, b, Precision.W4A4)
    assert not torch.equal(kernel.apply(layer, prepared, x2, b, Precision.W4A4), want)


def test_unshuffled_activation_scales_are_caught(fake_aiter):
    x = torch.randn(5, 128).to(torch.bfloat16)
    quant = fake_aiter.get_hip_quant(fake_aiter.aiter.QuantType.per_1x32)
    x_q, plain = quant(x, shuffle=False)
    w_q, w_s = quant(torch.randn(32, 128).to(torch.bfloat16), shuffle=False)
    w_sh = fake_aiter.shuffle_weight(w_q)
    w_s_sh = shuffle_scale_layout(w_s.view(torch.uint8)).view(w_s.dtype)
    with pytest.raises(FakeAiterError, match="A_scale must be the padded shuffled E8M0 layout"):
        fake_aiter.aiter.gemm_a4w4(x_q, w_sh, plain, w_s_sh)
