"""The emulated MXFP8 W8A8 kernel against a float64 reference written from the OCP rules
(``tests/formats/reference.py``: E4M3 grid, FLOOR exponent), sharing no code with the kernel."""

from __future__ import annotations

import pytest
import torch

from tests.formats import reference as ref
from vllm_omni_mxfp4.config import Precision
from vllm_omni_mxfp4.formats import quantize_mxfp8
from vllm_omni_mxfp4.kernels import EmulatedMxfp8, MxLayerSpec

N, K = 24, 96


def _layer(w):
    layer = torch.nn.Module()
    data, scale = quantize_mxfp8(w)
    layer.weight = torch.nn.Parameter(data, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    return layer


def _reference(x, w, bias):
    """float64 ``qdq(x) @ qdq(w)^T + bias``, each row quantized by the reference."""

    def qdq(row):
        elems, scales = ref.quantize_row(row, "floor", "fp8")
        return [e * 2.0 ** (scales[i // 32] - 127) for i, e in enumerate(elems)]

    xs = torch.tensor([qdq(r) for r in x.double().tolist()], dtype=torch.float64)
    ws = torch.tensor([qdq(r) for r in w.double().tolist()], dtype=torch.float64)
    return xs @ ws.T + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compute", ["float32", "auto"])
def test_emulated_mxfp8_equals_the_float64_reference_up_to_accumulation(dtype, compute):
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(N, K, generator=g) * 0.05).to(dtype)
    x = (torch.randn(7, K, generator=g) * torch.exp(torch.randn(7, K, generator=g))).to(dtype)
    bias = (torch.randn(N, generator=g) * 0.1).to(dtype)
    kernel = EmulatedMxfp8(compute_dtype=compute, cache_dequantized=compute == "auto")
    spec = MxLayerSpec("blocks.0.ffn.net_2", "mxfp8", "floor", K, N)
    layer = _layer(w)
    out = kernel.apply(layer, kernel.prepare(layer, spec, None), x, bias, Precision.W8A8)
    assert out.dtype == dtype
    want = _reference(x, w, bias)
    ulp = 2.0**-20 if (dtype, compute) == (torch.float32, "float32") else 2.0**-7
    magnitude = (want.abs() + 1e-6).max()
    assert bool(((out.double() - want).abs() <= ulp * magnitude).all())


def test_the_kernel_refuses_what_it_cannot_run():
    kernel = EmulatedMxfp8()
    assert kernel.can_implement(MxLayerSpec("p", "mxfp8", "floor", K, N))[0]
    for spec, match in (
        (MxLayerSpec("p", "mxfp8", "uos", K, N), "scale_rule:uos is not supported"),
        (MxLayerSpec("p", "mxfp8", "floor", K, N, w4a8=True), "w4a8 is not supported"),
        (MxLayerSpec("p", "mxfp4", "floor", K, N), "mxfp4 is not supported"),
    ):
        ok, why = kernel.can_implement(spec)
        assert not ok and match in why
