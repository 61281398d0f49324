"""The emulated kernels the vendor kernels are compared with: the AITER mirror, K padding, dual fp32.

References are computed here from the formats core's quantize/dequantize and float32 GEMMs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_omni_mxfp4.config import Precision
from vllm_omni_mxfp4.formats import dequantize_dualscale, dequantize_mx, quantize_dualscale, quantize_mx
from vllm_omni_mxfp4.kernels import EmulatedAiterSingle, EmulatedDual, EmulatedSingle, MxLayerSpec

K, N = 256, 48


def _spec(fmt="mxfp4", k=K, rule="floor", **kw):
    return MxLayerSpec("p", fmt, rule, k, N, **kw)


def _data(seed, k=K, n=N, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    x = (torch.randn(5, k, generator=g) * torch.exp(torch.randn(5, k, generator=g))).to(dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype)
    return w, x, b


def test_mirror_values_and_environment(monkeypatch):
    with pytest.raises(ValueError, match=r"'npu', 'rocm', 'rocm:rceil', 'rocm:aiter_legacy'.*got 'rocm:uos'"):
        EmulatedAiterSingle(rule="uos")
    monkeypatch.setenv("VLLM_OMNI_MXFP4_EMULATED_MIRROR", "rocm:aiter_legacy")
    kernel = EmulatedAiterSingle()
    assert kernel.rule == "aiter_legacy" and "rocm:aiter_legacy numerics" in kernel.describe()
    monkeypatch.setenv("VLLM_OMNI_MXFP4_EMULATED_MIRROR", "rocm")
    assert EmulatedAiterSingle().rule == "rceil"
    with pytest.raises(ValueError, match="emulated compute_dtype must be 'auto' or 'float32'"):
        EmulatedSingle(compute_dtype="float16")


@pytest.mark.parametrize("rule", ["rceil", "aiter_legacy"])
def test_aiter_mirror_weights_use_aiters_rule_on_bf16(plain_layer, rule):
    w, _, _ = _data(1)
    kernel = EmulatedAiterSingle(rule=rule)
    got = kernel.quantize_weight(w, _spec())
    want_data, want_scale = quantize_mx(w.to(torch.bfloat16), scale_rule=rule)
    assert torch.equal(got["weight"], want_data) and torch.equal(got["weight_scale"], want_scale)
    assert not torch.equal(got["weight_scale"], quantize_mx(w.to(torch.bfloat16))[1])  # not FLOOR
    with pytest.raises(NotImplementedError, match="mxfp4_scale_alg=2"):
        kernel.quantize_weight(w, _spec(rule="uos"))
    with pytest.raises(NotImplementedError, match="mxfp4_dualscale"):
        kernel.quantize_weight(w, _spec("mxfp4_dualscale"))
    with pytest.raises(NotImplementedError, match="mxfp4_dualscale"):
        kernel.prepare(plain_layer({}), _spec("mxfp4_dualscale"), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_aiter_mirror_forward(plain_layer, dtype):
    """Smooth in the caller's dtype, bf16 activations, AITER's rule, bf16 GEMM output, bias after."""
    w, x, b = _data(2, dtype=dtype)
    data, scale = quantize_mx(w.float())
    smooth = torch.exp(0.3 * torch.randn(K, generator=torch.Generator().manual_seed(3))).to(dtype)
    kernel = EmulatedAiterSingle(rule="rceil", compute_dtype="float32")
    layer = plain_layer({"weight": data, "weight_scale": scale})
    prepared = kernel.prepare(layer, _spec(), smooth)
    out = kernel.apply(layer, prepared, x, b, Precision.W4A4)
    xs = x * smooth
    xs = xs if dtype != torch.float32 else xs.to(torch.bfloat16)
    xq = dequantize_mx(*quantize_mx(xs, scale_rule="rceil"))
    want = F.linear(xq, dequantize_mx(data, scale)).to(torch.bfloat16)
    want = (want.float() + b.float()).to(dtype)
    assert out.dtype == dtype and torch.equal(out, want)
    with pytest.raises(NotImplementedError, match="W4A8"):
        kernel.apply(layer, prepared, x, b, Precision.W4A8)


def test_dualscale_float32_callers_get_the_kernels_bf16_output(plain_layer):
    k = 1024
    w, x, b = _data(4, k=k)
    data, scale, dual = quantize_dualscale(w.to(torch.bfloat16))
    kernel = EmulatedDual()
    layer = plain_layer({"weight": data, "weight_scale": scale, "weight_dual_scale": dual.unsqueeze(-1)})
    prepared = kernel.prepare(layer, _spec("mxfp4_dualscale", k=k), None)
    out = kernel.apply(layer, prepared, x, b, Precision.W4A4)
    xq = dequantize_dualscale(*quantize_dualscale(x.to(torch.bfloat16)))
    full = F.linear(xq, dequantize_dualscale(data, scale, dual), b)
    assert out.dtype == torch.float32 and torch.equal(out, full.to(torch.bfloat16).float())
    assert not torch.equal(out, full)


@pytest.mark.parametrize("mirror,a8", [("npu", False), ("npu", True), ("rocm:rceil", False)])
def test_single_scale_k_padding_aligns_activation_blocks(plain_layer, mirror, a8):
    """A shard [16, 80) of a K=96 layer: its activation blocks start 16 elements before its K."""
    k_full, k0, k, front, back = 96, 16, 64, 16, 16
    w, x_full, _ = _data(5, k=k_full, dtype=torch.bfloat16)
    data, scale = quantize_mx(w, scale_rule="floor")
    x = x_full[:, k0 : k0 + k].contiguous()
    spec = _spec(k=k, w4a8=a8, k_pad_front=front, k_pad_back=back)
    if mirror == "npu":
        kernel = EmulatedSingle(compute_dtype="float32")
    else:
        kernel = EmulatedAiterSingle(rule="rceil", compute_dtype="float32")
    layer = plain_layer({"weight": data[:, k0 // 2 : (k0 + k) // 2], "weight_scale": scale})
    prepared = kernel.prepare(layer, spec, None)
    out = kernel.apply(layer, prepared, x, None, Precision.W4A8 if a8 else Precision.W4A4)
    elem = "fp8" if a8 else "fp4"
    rule = "floor" if mirror == "npu" else "rceil"
    xq = dequantize_mx(*quantize_mx(F.pad(x, (front, back)), elem=elem, scale_rule=rule), elem=elem)
    want = F.linear(xq[:, front : front + k], dequantize_mx(data, scale)[:, k0 : k0 + k])
    want = want.to(torch.bfloat16)
    assert torch.equal(out, want)
    unaligned = dequantize_mx(*quantize_mx(x, elem=elem, scale_rule=rule), elem=elem)
    assert not torch.equal(xq[:, front : front + k], unaligned)  # the alignment matters for this data


def test_can_implement_declares_what_each_kernel_runs():
    assert EmulatedSingle().can_implement(_spec(rule="uos", w4a8=True))[0]
    ok, why = EmulatedDual().can_implement(_spec(w4a8=True))
    assert not ok and "mxfp4 is not supported by the emulated backend" in why
    ok, why = EmulatedAiterSingle(rule="rceil").can_implement(_spec(rule="uos"))
    assert not ok and "p: mxfp4_scale_alg=2" in why and "mirror='rocm:rceil'" in why
