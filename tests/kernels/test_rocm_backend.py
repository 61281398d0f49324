"""The ROCm kernel on the semantic AITER fake, against the emulated kernel mirroring AITER.

Each test runs for both AITER eras (scale rule ``rceil`` since 2026-06, ``aiter_legacy`` before);
the emulated kernel mirrors the same rule (``VLLM_OMNI_MXFP4_EMULATED_MIRROR=rocm:<rule>``). The
fake GEMM multiplies the dequantized operands in float32 as the emulated kernels with
``compute_dtype="float32"`` do, so outputs are bit-identical when both multiply the same problem
(no tile padding). How the kernel calls AITER is checked in ``test_rocm_binding.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.support.compare import assert_within_rounding, both
from tests.support.layers import K, N, build, run, smooth_vector, weights
from vllm_omni_mxfp4.config import Precision
from vllm_omni_mxfp4.formats import quantize_mx
from vllm_omni_mxfp4.kernels import AiterSingle, EmulatedAiterSingle, EmulatedSingle, MxLayerSpec, NpuSingle

from .conftest import install_aiter

pytestmark = pytest.mark.omni


def rocm_and_mirror(env, fake, spec, ckpt, **kw):
    return both(env, spec, ckpt, "rocm", mirror=f"rocm:{fake.rule}", **kw)


@pytest.mark.parametrize("kind", ["column", "row", "replicated"])
def test_online_mxfp4_equals_emulated_mirror(vllm_env, fake_aiter, kind):
    w, b, x = weights(40)
    rocm, emu = rocm_and_mirror(vllm_env, fake_aiter, {"method": "mxfp4"}, {"weight": w}, kind=kind, bias=b)
    assert AiterSingle().scale_rule(torch.device("cpu")) == fake_aiter.rule
    data, scale = quantize_mx(w, scale_rule=fake_aiter.rule)  # AITER's rule, not the config's FLOOR
    assert torch.equal(emu.weight_scale, scale) and torch.equal(emu.weight, data)
    state = rocm.state_dict()
    assert set(state) == {"weight", "weight_scale", "bias"}
    assert torch.equal(state["weight"], data) and torch.equal(state["weight_scale"], scale)
    out = run(vllm_env, rocm, x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, run(vllm_env, emu, x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_offline_checkpoint_with_smooth_equals_emulated_mirror(vllm_env, fake_aiter, dtype):
    """Beyond upstream: pre-quantized single-scale checkpoints (FLOOR scales from msModelSlim) on ROCm."""
    w, b, x = weights(41, dtype=dtype)
    data, scale = quantize_mx(w)
    ckpt = {"weight": data, "weight_scale": scale, "mul_scale": smooth_vector(K)}
    spec = {"method": "mxfp4", "is_checkpoint_mxfp4_serialized": True}
    rocm, emu = rocm_and_mirror(vllm_env, fake_aiter, spec, ckpt, dtype=dtype, bias=b)
    out = run(vllm_env, rocm, x)
    assert out.dtype == dtype and torch.equal(out, run(vllm_env, emu, x))
    assert torch.equal(rocm.state_dict()["weight"], data)
    # The Smooth vector really reaches the activations.
    plain = build(
        vllm_env, {**spec, "backend": "rocm"}, {"weight": data, "weight_scale": scale}, dtype=dtype, bias=b
    )
    assert not torch.equal(run(vllm_env, plain, x), out)


def test_shapes_off_the_aiter_tiles(vllm_env, fake_aiter):
    k, n = 80, 40  # K not a multiple of 32 (nor 64), N not of 16
    w, b, x = weights(42, n=n, k=k)
    rocm, emu = rocm_and_mirror(vllm_env, fake_aiter, {"method": "mxfp4"}, {"weight": w}, k=k, n=n, bias=b)
    assert rocm.weight.shape == (n, k // 2) and torch.equal(rocm.weight, emu.weight)  # not adopted: kept
    assert_within_rounding(run(vllm_env, rocm, x), run(vllm_env, emu, x))


def test_row_parallel_shard_with_k_padding(fake_aiter, plain_layer):
    k_full, k0, k = 96, 16, 32
    g = torch.Generator().manual_seed(43)
    w = (torch.randn(N, k_full, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(6, k, generator=g).to(torch.bfloat16)
    data, scale = quantize_mx(w)
    spec = MxLayerSpec("blocks.0.attn1.to_out", "mxfp4", "floor", k, N, k_pad_front=16, k_pad_back=16)
    ckpt = {"weight": data[:, k0 // 2 : (k0 + k) // 2], "weight_scale": scale[:, 0:2]}
    outs = []
    for kernel in (AiterSingle(), EmulatedAiterSingle(rule=fake_aiter.rule, compute_dtype="float32")):
        layer = plain_layer(ckpt)
        outs.append(kernel.apply(layer, kernel.prepare(layer, spec, None), x, None, Precision.W4A4))
    assert_within_rounding(*outs)


def test_older_gemm_signature_with_preallocated_output(vllm_env, monkeypatch):
    fake = install_aiter(monkeypatch, "aiter_legacy", gemm_api="out")
    w, b, x = weights(44)
    rocm, emu = rocm_and_mirror(vllm_env, fake, {"method": "mxfp4"}, {"weight": w}, bias=b)
    assert torch.equal(run(vllm_env, rocm, x), run(vllm_env, emu, x))


# -------------------------------------------------------------------------- detection and refusals


def test_scale_rule_is_probed_and_metadata_disagreement_is_logged(monkeypatch, caplog):
    install_aiter(monkeypatch, "aiter_legacy", metadata="RoundUp")  # metadata says RCEIL, kernel is legacy
    kernel = AiterSingle()
    assert kernel.metadata_rule == "rceil"
    with caplog.at_level(logging.WARNING, logger="vllm_omni_mxfp4.kernels.rocm"):
        assert kernel.scale_rule(torch.device("cpu")) == "aiter_legacy"
    assert "behaves as scale rule 'aiter_legacy'" in caplog.text
    assert "aiter_legacy" in kernel.describe()


@pytest.mark.parametrize("arch", [None, "gfx942:sramecc+:xnack-"])
def test_non_gfx950_gpus_are_refused(monkeypatch, arch):
    install_aiter(monkeypatch)
    import vllm_omni_mxfp4.kernels.rocm as rocm

    monkeypatch.setattr(rocm, "gpu_arch", lambda: arch)
    assert not AiterSingle.is_supported()[0]
    with pytest.raises(NotImplementedError, match=r"gfx950.*backend 'emulated'.*backend 'npu'"):
        AiterSingle()


@pytest.mark.parametrize(
    "fmt,rule,w4a8,match",
    [
        ("mxfp4_dualscale", "floor", False, "mxfp4_dualscale is not supported"),
        ("mxfp4", "uos", False, "mxfp4_scale_alg=2"),
        ("mxfp4", "floor", True, "W4A8 fallback"),
    ],
)
def test_what_aiter_cannot_run_is_refused_naming_alternatives(fake_aiter, fmt, rule, w4a8, match):
    spec = MxLayerSpec("blocks.0.x", fmt, rule, K, N, w4a8=w4a8)
    for kernel in (AiterSingle(), EmulatedAiterSingle(rule=fake_aiter.rule)):
        ok, why = kernel.can_implement(spec)
        assert not ok
        assert __import__("re").search(rf"blocks\.0\.x: {match}.*'emulated'.*'npu'", why), why
    assert AiterSingle().can_implement(MxLayerSpec("blocks.0.x", "mxfp4", "floor", K, N))[0]


def test_refusals_at_every_entry_point(vllm_env, fake_aiter, plain_layer):
    w, b, x = weights(46)
    kernel = AiterSingle()
    with pytest.raises(NotImplementedError, match="mxfp4_scale_alg=2"):
        kernel.quantize_weight(w, MxLayerSpec("p", "mxfp4", "uos", K, N))
    with pytest.raises(NotImplementedError, match="mxfp4_dualscale"):
        kernel.prepare(plain_layer({}), MxLayerSpec("p", "mxfp4_dualscale", "floor", K, N), None)
    with pytest.raises(NotImplementedError, match="mxfp4_dualscale is not supported by the ROCm backend"):
        build(vllm_env, {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0, "backend": "rocm"}, {})
    data, scale = quantize_mx(w)
    layer = plain_layer({"weight": data, "weight_scale": scale})
    prepared = kernel.prepare(layer, MxLayerSpec("p", "mxfp4", "floor", K, N), None)
    with pytest.raises(NotImplementedError, match="W4A8"):
        kernel.apply(layer, prepared, x.reshape(-1, K), None, Precision.W4A8)


def test_a_layer_moves_between_kernels(vllm_env, fake_aiter, fake_npu):
    """A kernel that adopted the weight's storage hands it back canonical to the next one."""
    w, b, x = weights(49)
    data, scale = quantize_mx(w)
    spec = {"method": "mxfp4", "is_checkpoint_mxfp4_serialized": True, "backend": "rocm"}
    layer = build(vllm_env, spec, {"weight": data, "weight_scale": scale}, bias=b)
    assert torch.equal(layer.state_dict()["weight"], data)
    outs = []
    for kernel in (NpuSingle(), EmulatedSingle(compute_dtype="float32")):
        layer.quant_method.use_kernel(layer, kernel)
        assert torch.equal(layer.weight.data, data)
        outs.append(run(vllm_env, layer, x))
    assert torch.equal(*outs)
