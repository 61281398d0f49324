"""Build the same quantized vLLM Linear on two backends and compare their outputs."""

from __future__ import annotations

import torch

from tests.omni.test_linear_methods import K, N, finish, load, make_layer, run, weights

__all__ = ["K", "N", "build", "run", "weights", "assert_within_rounding", "smooth_vector"]


def build(
    env,
    spec: dict,
    backend,
    ckpt: dict[str, torch.Tensor],
    *,
    kind: str = "column",
    k: int = K,
    n: int = N,
    dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    prefix: str = "blocks.1.attn2.to_q",
):
    """A vLLM Linear with ``spec``'s method on ``backend``, loaded with ``ckpt`` (+ bias), processed."""
    layer = make_layer(env, spec, kind, k=k, n=n, dtype=dtype, prefix=prefix, bias=bias is not None)
    layer.quant_method.backend = backend
    for name, tensor in ckpt.items():
        load(layer, name, tensor)
    if bias is not None:
        load(layer, "bias", bias)
    finish(env, layer)
    return layer


def assert_within_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 summation order: at most one ulp of the output dtype apart, mostly equal."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-20}[got.dtype]
    g, w = got.double(), want.double()
    bound = torch.maximum(g.abs(), w.abs()) * ulp + 1e-30
    assert bool(((g - w).abs() <= bound).all()), (g - w).abs().max()
    assert (g == w).double().mean() > 0.8


def smooth_vector(k: int, seed: int = 1) -> torch.Tensor:
    return torch.exp(0.5 * torch.randn(k, generator=torch.Generator().manual_seed(seed)))
