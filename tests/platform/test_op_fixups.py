"""The three op overrides (platform/op_fixups.py): still needed by the installed vLLM / vLLM-Omni, correct
against float64 references, leaving what upstream already handles to upstream."""

from __future__ import annotations

import pytest
import torch
from omni_procs import omni_installed

pytestmark = [
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]


def _packed_linear(n: int, k: int, seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    """A layer packed by vLLM's own CPU dispatch, as ``UnquantizedLinearMethod`` packs it after loading."""
    import vllm_omni  # noqa: F401  (resolve the platform before importing vLLM's layers)
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    return layer, weight


def _packed_linear_with_bias(n: int, k: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A BF16 layer with a bias, packed by vLLM's CPU dispatch (on AMX CPUs: SGL's packing, which
    makes the bias FP32), carrying ``params_dtype`` as vLLM's ``LinearBase`` does."""
    import vllm_omni  # noqa: F401
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    g = torch.Generator().manual_seed(2)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    layer = torch.nn.Module()
    layer.params_dtype = torch.bfloat16
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    layer.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    return layer, weight, bias


@pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(), reason="vLLM packs for SGL's kernel on AMX CPUs only"
)
def test_upstream_amx_gemm_still_refuses_the_input_dtype_its_bias_suggests() -> None:
    """Fails once vLLM's AMX packing keeps the bias in the weight's dtype (or its kernel takes an FP32
    input): then drop the dtype cast from cpu_unquantized_gemm."""
    from vllm_omni_mxfp4.platform.op_fixups import upstream_cpu_unquantized_gemm

    layer, _, _ = _packed_linear_with_bias(256, 256)
    assert layer.bias.dtype == torch.float32
    x = torch.randn(4, 256, dtype=layer.bias.dtype)
    with pytest.raises(NotImplementedError, match="not implemented for 'Float'"):
        upstream_cpu_unquantized_gemm()(layer, x, layer.weight, layer.bias)


def test_cpu_gemm_runs_an_input_in_the_dtype_of_the_layers_bias() -> None:
    """Z-Image's timestep embedder casts its input to ``mlp[0].bias.dtype``; whichever kernel vLLM
    packed for this CPU, the layer computes in BF16 as on CUDA."""
    from vllm_omni_mxfp4.platform.op_fixups import cpu_unquantized_gemm

    layer, weight, bias = _packed_linear_with_bias(256, 256)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)).to(layer.bias.dtype)
    got = cpu_unquantized_gemm(layer, x, layer.weight, layer.bias)
    reference = x.to(torch.bfloat16).double() @ weight.double().T + bias.double()
    assert got.dtype == torch.bfloat16 and got.shape == reference.shape
    torch.testing.assert_close(got.double(), reference, rtol=2e-2, atol=3e-2)


def _strided_input(k: int, tokens: int = 32, seed: int = 1) -> torch.Tensor:
    """(1, tokens, k) as a transposed view (last stride ``tokens``), as Sana-WM's output gate makes it."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, k, tokens, generator=g).to(torch.bfloat16).transpose(1, 2)


def test_upstream_cpu_gemm_still_refuses_a_strided_input() -> None:
    """Fails once vLLM's CPU GEMM takes strided inputs on an AVX-512 CPU: then drop
    cpu_unquantized_gemm from op_fixups. On an AVX2-only CPU vLLM packs no oneDNN or AMX weight and
    its GEMM takes the strided input; there the fixup must give what upstream gives."""
    from vllm_omni_mxfp4.platform.op_fixups import cpu_unquantized_gemm, upstream_cpu_unquantized_gemm

    layer, _ = _packed_linear(256, 256)
    x = _strided_input(256)
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        want = upstream_cpu_unquantized_gemm()(layer, x, layer.weight, None)
        torch.testing.assert_close(cpu_unquantized_gemm(layer, x, layer.weight, None), want, rtol=0, atol=0)
        return
    # oneDNN's message, or SGL's where vLLM packed for AMX tiles
    with pytest.raises(RuntimeError, match=r"stride\(-1\) == 1|must be contiguous at last dimension"):
        upstream_cpu_unquantized_gemm()(layer, x, layer.weight, None)


@pytest.mark.parametrize(("n", "k"), [(256, 256), (96, 64), (1024, 128)])
def test_cpu_gemm_takes_a_strided_input(n: int, k: int) -> None:
    from vllm_omni_mxfp4.platform.op_fixups import cpu_unquantized_gemm, upstream_cpu_unquantized_gemm

    layer, weight = _packed_linear(n, k)
    x = _strided_input(k)
    got = cpu_unquantized_gemm(layer, x, layer.weight, None)
    # the same packed kernel on a row-major copy: bit for bit
    want = upstream_cpu_unquantized_gemm()(layer, x.contiguous(), layer.weight, None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    reference = x.double() @ weight.double().T
    assert got.shape == reference.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), reference, rtol=2e-2, atol=2e-2)


def _rope_inputs(heads: int = 4, tokens: int = 12, head_dim: int = 16):
    """x (2, tokens, heads, head_dim) and a per-token (tokens, head_dim / 2) table of angles, bf16."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, tokens, heads, head_dim, generator=g).to(torch.bfloat16)
    angles = torch.rand(tokens, head_dim // 2, generator=g, dtype=torch.float64) * 6.0
    return x, angles


def _rope_reference(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (x[2i], x[2i+1]) rotated by the token's angle, every head alike, in complex128."""
    pairs = x.double().unflatten(-1, (-1, 2))
    z = torch.complex(pairs[..., 0], pairs[..., 1]) * torch.polar(torch.ones_like(angles), angles)[:, None]
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2)


def _wan_rope():
    import vllm_omni  # noqa: F401
    from vllm_omni.diffusion.layers.rope import RotaryEmbeddingWan

    return RotaryEmbeddingWan(is_neox_style=False, half_head_dim=True)


def test_upstream_wan_rope_still_misreads_a_per_token_table() -> None:
    """Fails once vLLM-Omni's native Wan rotary takes LingBot-World's (tokens, head_dim / 2) table:
    then drop wan_rope_native from op_fixups."""
    from vllm_omni_mxfp4.platform.op_fixups import upstream_wan_rope_native

    x, angles = _rope_inputs()
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    with pytest.raises(RuntimeError, match="must match the size"):
        upstream_wan_rope_native()(_wan_rope(), x, cos, sin)


def test_wan_rope_rotates_each_token_by_its_row_of_the_table() -> None:
    from vllm_omni_mxfp4.platform.op_fixups import wan_rope_native

    x, angles = _rope_inputs()
    got = wan_rope_native(_wan_rope(), x, angles.cos().to(x.dtype), angles.sin().to(x.dtype))
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), _rope_reference(x, angles), rtol=0, atol=3e-2)
    # a table whose rows are not the tokens is not this layout: upstream's method decides
    with pytest.raises(RuntimeError, match="must match the size"):
        wan_rope_native(_wan_rope(), x, angles.cos()[:5].to(x.dtype), angles.sin()[:5].to(x.dtype))


def test_wan_rope_leaves_a_table_with_a_heads_axis_to_upstream() -> None:
    """Wan2.2's layout (1, tokens, 1, head_dim / 2): the same result as upstream's own method."""
    from vllm_omni_mxfp4.platform.op_fixups import upstream_wan_rope_native, wan_rope_native

    x, angles = _rope_inputs()
    cos, sin = (t.to(x.dtype)[None, :, None] for t in (angles.cos(), angles.sin()))
    rope = _wan_rope()
    got = wan_rope_native(rope, x, cos, sin)
    torch.testing.assert_close(got, upstream_wan_rope_native()(rope, x, cos, sin), rtol=0, atol=0)
    torch.testing.assert_close(got.double(), _rope_reference(x, angles), rtol=0, atol=3e-2)


def _qkv(heads: int = 4, kv_heads: int = 4, tokens: int = 24, head_dim: int = 16, dtype=torch.float32):
    """Query (B, H, S, D) and a key/value chunk as ring attention hands them to its SDPA op."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, heads, tokens, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(2, kv_heads, tokens + 8, head_dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def test_upstream_ring_kernel_is_still_cuda_only() -> None:
    """Fails once PyTorch runs the efficient SDPA op on the CPU: then drop ring_chunk_attention."""
    from vllm_omni_mxfp4.platform.op_fixups import upstream_ring_chunk_attention

    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="_scaled_dot_product_efficient_attention"):
        upstream_ring_chunk_attention()(q, k, v, None, True, 0.0, False, scale=None)


@pytest.mark.parametrize("causal", [False, True])
def test_ring_chunk_attention_returns_the_output_and_natural_log_lse(causal: bool) -> None:
    from vllm_omni_mxfp4.platform.op_fixups import ring_chunk_attention

    q, k, v = _qkv()
    k, v = k[:, :, : q.shape[2]], v[:, :, : q.shape[2]]
    scale = 0.3
    out, lse = ring_chunk_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    logits = scale * q.double() @ k.double().transpose(-1, -2)
    if causal:
        logits = logits.masked_fill(torch.ones_like(logits, dtype=torch.bool).triu(1), float("-inf"))
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits, -1), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.double(), torch.softmax(logits, -1) @ v.double(), rtol=0, atol=1e-5)


def test_ring_merges_two_chunks_into_full_attention() -> None:
    """Upstream's ring step (pytorch_attn_forward per chunk, then its lse merge) over two key/value
    chunks equals attention over all keys: what two ring ranks compute for their queries."""
    from vllm_omni.diffusion.attention.backends.ring import ring_kernels, ring_utils

    from vllm_omni_mxfp4.platform.op_fixups import install_op_fixups

    install_op_fixups()
    q, k, v = (t.transpose(1, 2) for t in _qkv(tokens=16))  # (B, S, H, D), as ring passes them
    k, v = k[:, :32], v[:, :32]
    out, lse = None, None
    for chunk in (slice(0, 16), slice(16, 32)):
        block_out, block_lse = ring_kernels.pytorch_attn_forward(q, k[:, chunk], v[:, chunk], causal=False)
        out, lse = ring_utils.update_out_and_lse(out, lse, block_out, block_lse, lse_layout="bhs")
    full = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v)))
    torch.testing.assert_close(out.double(), full.transpose(1, 2), rtol=0, atol=1e-5)


def test_install_overrides_all_three_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_omni  # noqa: F401
    from vllm.model_executor.layers import utils
    from vllm_omni.diffusion.attention.backends.ring import ring_kernels
    from vllm_omni.diffusion.layers.rope import RotaryEmbeddingWan

    from vllm_omni_mxfp4.platform.op_fixups import (
        install_op_fixups,
        upstream_cpu_unquantized_gemm,
        upstream_ring_chunk_attention,
        upstream_wan_rope_native,
    )

    gemm, rope, ring = (
        upstream_cpu_unquantized_gemm(),
        upstream_wan_rope_native(),
        upstream_ring_chunk_attention(),
    )
    monkeypatch.setattr(utils, "cpu_unquantized_gemm", gemm)
    monkeypatch.setattr(RotaryEmbeddingWan, "forward_native", rope)
    monkeypatch.setattr(ring_kernels, "_scaled_dot_product_efficient_attention", ring)
    assert len(install_op_fixups()) == 3
    assert (
        utils.cpu_unquantized_gemm is not gemm and RotaryEmbeddingWan.__dict__["forward_native"] is not rope
    )
    assert ring_kernels._scaled_dot_product_efficient_attention is not ring
    assert install_op_fixups() == []  # idempotent
    assert upstream_cpu_unquantized_gemm() is gemm and upstream_wan_rope_native() is rope
    assert upstream_ring_chunk_attention() is ring

    # what a layer built afterwards binds: vLLM's dispatch and vLLM-Omni's CustomOp dispatch
    assert utils.dispatch_unquantized_gemm() is utils.cpu_unquantized_gemm
    layer, weight = _packed_linear(96, 64)
    x = _strided_input(64)
    out = utils.dispatch_unquantized_gemm()(layer, x, layer.weight, None)
    torch.testing.assert_close(out.double(), x.double() @ weight.double().T, rtol=2e-2, atol=2e-2)
    x4, angles = _rope_inputs()
    got = _wan_rope()(x4, angles.cos().to(x4.dtype), angles.sin().to(x4.dtype))
    torch.testing.assert_close(got.double(), _rope_reference(x4, angles), rtol=0, atol=3e-2)
