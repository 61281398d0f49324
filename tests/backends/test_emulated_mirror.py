"""The emulated backend's options added for the vendor backends: mirroring AITER, K padding, dual fp32.

References are computed here from the formats core's quantize/dequantize and float32 GEMMs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_omni_mxfp4.backends import EmulatedBackend, MxLayerSpec
from vllm_omni_mxfp4.backends.emulated import parse_mirror
from vllm_omni_mxfp4.formats import (
    dequantize_dualscale,
    dequantize_mx,
    quantize_dualscale,
    quantize_mx,
)

K, N = 256, 48


def _layer(ckpt, smooth=None):
    layer = torch.nn.Module()
    for name, t in ckpt.items():
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    if smooth is not None:
        layer.register_buffer("_mx_smooth", smooth, persistent=False)
    return layer


def _data(seed, k=K, n=N, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    x = (torch.randn(5, k, generator=g) * torch.exp(torch.randn(5, k, generator=g))).to(dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype)
    return w, x, b


def test_mirror_values_and_environment(monkeypatch):
    assert parse_mirror("npu") is None and parse_mirror(" ROCm ") == "rceil"
    assert parse_mirror("rocm:aiter_legacy") == "aiter_legacy"
    with pytest.raises(ValueError, match=r"'npu', 'rocm', 'rocm:rceil', 'rocm:aiter_legacy'.*got 'rocm:uos'"):
        parse_mirror("rocm:uos")
    monkeypatch.setenv("VLLM_OMNI_MXFP4_EMULATED_MIRROR", "rocm:aiter_legacy")
    backend = EmulatedBackend()
    assert backend.aiter_rule == "aiter_legacy" and "rocm:aiter_legacy numerics" in backend.describe()
    assert EmulatedBackend(mirror="npu").aiter_rule is None


@pytest.mark.parametrize("rule", ["rceil", "aiter_legacy"])
def test_aiter_mirror_weights_use_aiters_rule_on_bf16(rule):
    w, _, _ = _data(1)
    backend = EmulatedBackend(mirror=f"rocm:{rule}")
    data, scale = backend.quantize_weight(w, "floor")
    want_data, want_scale = quantize_mx(w.to(torch.bfloat16), scale_rule=rule)
    assert torch.equal(data, want_data) and torch.equal(scale, want_scale)
    assert not torch.equal(scale, quantize_mx(w.to(torch.bfloat16))[1])  # not FLOOR
    with pytest.raises(NotImplementedError, match="mxfp4_scale_alg=2"):
        backend.quantize_weight(w, "uos")
    with pytest.raises(NotImplementedError, match="mxfp4_dualscale"):
        backend.quantize_weight_dualscale(w)
    with pytest.raises(NotImplementedError, match="mxfp4_dualscale"):
        backend.prepare(_layer({}), MxLayerSpec("p", True, "floor", K, N, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_aiter_mirror_forward(dtype):
    """Smooth in the caller's dtype, bf16 activations, AITER's rule, bf16 GEMM output, bias after."""
    w, x, b = _data(2, dtype=dtype)
    data, scale = quantize_mx(w.float())
    smooth = torch.exp(0.3 * torch.randn(K, generator=torch.Generator().manual_seed(3))).to(dtype)
    spec = MxLayerSpec("p", False, "floor", K, N, True)
    backend = EmulatedBackend(mirror="rocm:rceil", compute_dtype="float32")
    layer = _layer({"weight": data, "weight_scale": scale}, smooth)
    backend.prepare(layer, spec)
    out = backend.linear(layer, spec, x, b, a8=False)
    xs = x * smooth
    xs = xs if dtype != torch.float32 else xs.to(torch.bfloat16)
    xq = dequantize_mx(*quantize_mx(xs, scale_rule="rceil"))
    want = F.linear(xq, dequantize_mx(data, scale)).to(torch.bfloat16)
    want = (want.float() + b.float()).to(dtype)
    assert out.dtype == dtype and torch.equal(out, want)
    with pytest.raises(NotImplementedError, match="W4A8"):
        backend.linear(layer, spec, x, b, a8=True)


def test_dualscale_float32_callers_get_the_kernels_bf16_output():
    k = 1024
    w, x, b = _data(4, k=k)
    data, scale, dual = quantize_dualscale(w.to(torch.bfloat16))
    spec = MxLayerSpec("p", True, "floor", k, N, False)
    backend = EmulatedBackend()
    layer = _layer({"weight": data, "weight_scale": scale, "weight_dual_scale": dual.unsqueeze(-1)})
    backend.prepare(layer, spec)
    out = backend.linear(layer, spec, x, b, a8=False)
    xq = dequantize_dualscale(*quantize_dualscale(x.to(torch.bfloat16)))
    full = F.linear(xq, dequantize_dualscale(data, scale, dual), b)
    assert out.dtype == torch.float32 and torch.equal(out, full.to(torch.bfloat16).float())
    assert not torch.equal(out, full)


@pytest.mark.parametrize("mirror,a8", [("npu", False), ("npu", True), ("rocm:rceil", False)])
def test_single_scale_k_padding_aligns_activation_blocks(mirror, a8):
    """A shard [16, 80) of a K=96 layer: its activation blocks start 16 elements before its K."""
    k_full, k0, k, front, back = 96, 16, 64, 16, 16
    w, x_full, _ = _data(5, k=k_full, dtype=torch.bfloat16)
    data, scale = quantize_mx(w, scale_rule="floor")
    x = x_full[:, k0 : k0 + k].contiguous()
    spec = MxLayerSpec("p", False, "floor", k, N, False, k_pad_front=front, k_pad_back=back)
    backend = EmulatedBackend(mirror=mirror, compute_dtype="float32")
    layer = _layer({"weight": data[:, k0 // 2 : (k0 + k) // 2].contiguous(), "weight_scale": scale})
    backend.prepare(layer, spec)
    out = backend.linear(layer, spec, x, None, a8=a8)
    elem = "fp8" if a8 else "fp4"
    rule = "floor" if mirror == "npu" else "rceil"
    xq = dequantize_mx(*quantize_mx(F.pad(x, (front, back)), elem=elem, scale_rule=rule), elem=elem)
    want = F.linear(xq[:, front : front + k], dequantize_mx(data, scale)[:, k0 : k0 + k])
    want = want.to(torch.bfloat16)
    assert torch.equal(out, want)
    unaligned = dequantize_mx(*quantize_mx(x, elem=elem, scale_rule=rule), elem=elem)
    assert not torch.equal(xq[:, front : front + k], unaligned)  # the alignment matters for this data
