"""One reference forward, a reference kernel built on it, and comparisons of two builds of a layer.

The reference of a quantized Linear is built from the formats core alone: the dequantized weight
times the quantized-then-dequantized activation, in float32, plus bias, cast to the caller's dtype
(W4A8: a bf16 bias and a bf16-rounded output, as the NPU mixed kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_omni_mxfp4.config import Precision
from vllm_omni_mxfp4.formats import dequantize_dualscale, dequantize_mx, quantize_dualscale, quantize_mx
from vllm_omni_mxfp4.kernels import MxKernel, Prepared

from .layers import build


def reference(
    x, w_deq, bias, *, act="fp4", rule="floor", smooth=None, out_dtype=None, w4a8_bf16=False, dual=False
):
    """``qdq(x * smooth) @ w_deq^T + bias`` in float32, in ``out_dtype`` (default: ``x``'s)."""
    out_dtype = out_dtype or x.dtype
    if smooth is not None:
        x = x * smooth.to(x.dtype)
    if dual:
        xq = dequantize_dualscale(*quantize_dualscale(x))
    else:
        xq = dequantize_mx(*quantize_mx(x, elem=act, scale_rule=rule), elem=act, dtype=torch.float32)
    b = None if bias is None else (bias.to(torch.bfloat16) if w4a8_bf16 else bias).float()
    out = F.linear(xq, w_deq.float(), b)
    if w4a8_bf16:
        out = out.to(torch.bfloat16)
    return out.to(out_dtype)


class ReferenceKernel(MxKernel):
    """A kernel computing :func:`reference` from the layer's checkpoint tensors (model-level oracle)."""

    backend = "reference"
    w4a8 = True

    def __init__(self, fmt: str) -> None:
        self.format = fmt

    def _quantize_weight(self, weight, spec):
        raise AssertionError("the reference only runs forwards")

    def _prepare(self, layer, spec, smooth):
        return Prepared(spec, smooth)

    def _matmul(self, x, call):
        layer, a8 = call.layer, call.precision is Precision.W4A8
        if self.format == "mxfp4_dualscale":
            w = dequantize_dualscale(layer.weight, layer.weight_scale, layer.weight_dual_scale)
            return reference(x, w, call.bias, dual=True)
        if self.format == "mxfp8":  # W8A8: E4M3 weights, OCP MXFP8 activations
            w = dequantize_mx(layer.weight, layer.weight_scale, elem="fp8")
            return reference(x, w, call.bias, act="fp8", rule="floor")
        w = dequantize_mx(layer.weight, layer.weight_scale)
        act, rule = ("fp8", "floor") if a8 else ("fp4", call.spec.scale_rule)
        return reference(x, w, call.bias, act=act, rule=rule, w4a8_bf16=a8)


def both(env, spec, ckpt, backend, *, mirror="npu", **kw):
    """The same layer on ``backend`` (a vendor kernel on its fake) and on the emulated kernels
    (float32 GEMM, mirroring ``mirror``'s numerics): ``(vendor, emulated)``."""
    vendor = build(env, {**spec, "backend": backend}, ckpt, **kw)
    emulated = build(env, {**spec, "backend": "emulated"}, ckpt, mirror=mirror, **kw)
    return vendor, emulated


def assert_within_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 summation order: at most one ulp of the output dtype apart, mostly equal."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-20}[got.dtype]
    g, w = got.double(), want.double()
    bound = torch.maximum(g.abs(), w.abs()) * ulp + 1e-30
    assert bool(((g - w).abs() <= bound).all()), (g - w).abs().max()
    assert (g == w).double().mean() > 0.8
