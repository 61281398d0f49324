"""The ROCm backend on the semantic AITER fake, against the emulated backend mirroring AITER.

Each test runs for both AITER eras (scale rule ``rceil`` since 2026-06, ``aiter_legacy`` before);
the emulated backend mirrors the same rule (``mirror="rocm:<rule>"``). The fake GEMM multiplies the
dequantized operands in float32 as the emulated backend with ``compute_dtype="float32"`` does, so
outputs are bit-identical when both multiply the same problem (no tile padding).
"""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_omni_mxfp4.backends import EmulatedBackend, MxLayerSpec
from vllm_omni_mxfp4.formats import quantize_mx

from .conftest import install_aiter
from .fake_aiter import FakeAiterError, shuffle_scale_layout
from .harness import K, N, assert_within_rounding, build, run, smooth_vector, weights

pytestmark = pytest.mark.omni


def mirror(fake) -> EmulatedBackend:
    return EmulatedBackend(compute_dtype="float32", mirror=f"rocm:{fake.rule}")


def both(env, rocm_backend, fake, spec, ckpt, **kw):
    return build(env, spec, rocm_backend, ckpt, **kw), build(env, spec, mirror(fake), ckpt, **kw)


@pytest.mark.parametrize("kind", ["column", "row", "replicated"])
def test_online_mxfp4_equals_emulated_mirror(vllm_env, rocm_backend, fake_aiter, kind):
    w, b, x = weights(40)
    spec = {"method": "mxfp4", "backend": "emulated"}
    rocm, emu = both(vllm_env, rocm_backend, fake_aiter, spec, {"weight": w}, kind=kind, bias=b)
    assert rocm_backend.scale_rule(torch.device("cpu")) == fake_aiter.rule
    data, scale = quantize_mx(w, scale_rule=fake_aiter.rule)  # AITER's rule, not the config's FLOOR
    assert torch.equal(emu.weight_scale, scale) and torch.equal(emu.weight, data)
    state = rocm.state_dict()
    assert set(state) == {"weight", "weight_scale", "bias"}
    assert torch.equal(state["weight"], data) and torch.equal(state["weight_scale"], scale)
    assert not torch.equal(rocm.weight.data, data)  # the parameter holds AITER's shuffled bytes
    out = run(vllm_env, rocm, x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, run(vllm_env, emu, x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_offline_checkpoint_with_smooth_equals_emulated_mirror(vllm_env, rocm_backend, fake_aiter, dtype):
    """Beyond upstream: pre-quantized single-scale checkpoints (FLOOR scales from msModelSlim) on ROCm."""
    w, b, x = weights(41, dtype=dtype)
    data, scale = quantize_mx(w)
    ckpt = {"weight": data, "weight_scale": scale, "mul_scale": smooth_vector(K)}
    spec = {"method": "mxfp4", "is_checkpoint_mxfp4_serialized": True, "backend": "emulated"}
    rocm, emu = both(vllm_env, rocm_backend, fake_aiter, spec, ckpt, dtype=dtype, bias=b)
    out = run(vllm_env, rocm, x)
    assert out.dtype == dtype and torch.equal(out, run(vllm_env, emu, x))
    assert torch.equal(rocm.state_dict()["weight"], data)
    # The Smooth vector really reaches the activations.
    plain = build(vllm_env, spec, rocm_backend, {"weight": data, "weight_scale": scale}, dtype=dtype, bias=b)
    assert not torch.equal(run(vllm_env, plain, x), out)


def test_shapes_off_the_aiter_tiles_are_padded(vllm_env, rocm_backend, fake_aiter):
    k, n = 80, 40  # K not a multiple of 32 (nor 64), N not of 16
    w, b, x = weights(42, n=n, k=k)
    spec = {"method": "mxfp4", "backend": "emulated"}
    rocm, emu = both(vllm_env, rocm_backend, fake_aiter, spec, {"weight": w}, k=k, n=n, bias=b)
    assert rocm._mx_rocm_weight.shape == (48, 64)  # (roundup(N, 16), roundup(K, 64) / 2)
    assert rocm.weight.shape == (n, k // 2) and torch.equal(rocm.weight, emu.weight)  # not adopted: kept
    assert_within_rounding(run(vllm_env, rocm, x), run(vllm_env, emu, x))


def test_row_parallel_shard_with_k_padding(rocm_backend, fake_aiter):
    k_full, k0, k = 96, 16, 32
    front, back = 16, 16
    g = torch.Generator().manual_seed(43)
    w = (torch.randn(N, k_full, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(6, k, generator=g).to(torch.bfloat16)
    data, scale = quantize_mx(w)
    spec = MxLayerSpec(
        "blocks.0.attn1.to_out", False, "floor", k, N, False, k_pad_front=front, k_pad_back=back
    )
    outs = []
    for backend in (rocm_backend, mirror(fake_aiter)):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(data[:, k0 // 2 : (k0 + k) // 2].clone(), requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale[:, 0:2].clone(), requires_grad=False)
        backend.prepare(layer, spec)
        outs.append(backend.linear(layer, spec, x, None, a8=False))
    assert_within_rounding(*outs)


def test_older_gemm_signature_with_preallocated_output(vllm_env, monkeypatch):
    fake = install_aiter(monkeypatch, "aiter_legacy", gemm_api="out")
    from vllm_omni_mxfp4.backends.rocm import RocmBackend

    w, b, x = weights(44)
    spec = {"method": "mxfp4", "backend": "emulated"}
    rocm, emu = both(vllm_env, RocmBackend(), fake, spec, {"weight": w}, bias=b)
    assert torch.equal(run(vllm_env, rocm, x), run(vllm_env, emu, x))
    _, gemm_args, _ = [c for c in fake.calls if c[0] == "gemm_a4w4"][-1]
    assert len(gemm_args) == 5 and gemm_args[4].dtype == torch.bfloat16  # (A, B, A_scale, B_scale, out)


def test_torch_compile_traces_around_the_custom_op(vllm_env, rocm_backend, fake_aiter):
    w, b, x = weights(45)
    layer = build(vllm_env, {"method": "mxfp4", "backend": "emulated"}, rocm_backend, {"weight": w}, bias=b)
    spec, x2 = layer._mx_spec, x.reshape(-1, K)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(
        lambda t: rocm_backend.linear(layer, spec, t, layer.bias, a8=False), backend=counting, fullgraph=True
    )
    assert torch.equal(compiled(x2), rocm_backend.linear(layer, spec, x2, layer.bias, a8=False))
    targets = {str(node.target) for node in graphs[0].graph.nodes}
    assert any("rocm_mxfp4_gemm" in t for t in targets), targets
    # The fake implementation agrees with the real one on what compile needs: shape, dtype, device.
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = (x2.contiguous(), layer._mx_rocm_weight, layer._mx_rocm_scale)
    real = torch.ops.vllm_omni_mxfp4.rocm_mxfp4_gemm(*args, N)
    with FakeTensorMode() as mode:
        fake = torch.ops.vllm_omni_mxfp4.rocm_mxfp4_gemm(*(mode.from_tensor(a) for a in args), N)
    assert (fake.shape, fake.dtype, fake.device) == (real.shape, real.dtype, real.device)


# -------------------------------------------------------------------------- detection and refusals


def test_scale_rule_is_probed_and_metadata_disagreement_is_logged(monkeypatch, caplog):
    install_aiter(monkeypatch, "aiter_legacy", metadata="RoundUp")  # metadata says RCEIL, kernel is legacy
    from vllm_omni_mxfp4.backends.rocm import RocmBackend

    backend = RocmBackend()
    assert backend.metadata_rule == "rceil"
    with caplog.at_level(logging.WARNING, logger="vllm_omni_mxfp4.backends.rocm"):
        assert backend.scale_rule(torch.device("cpu")) == "aiter_legacy"
    assert "behaves as scale rule 'aiter_legacy'" in caplog.text
    assert "aiter_legacy" in backend.describe()


@pytest.mark.parametrize("arch", [None, "gfx942:sramecc+:xnack-"])
def test_non_gfx950_gpus_are_refused(monkeypatch, arch):
    install_aiter(monkeypatch)
    import vllm_omni_mxfp4.backends.rocm as rocm

    monkeypatch.setattr(rocm, "gpu_arch", lambda: arch)
    with pytest.raises(NotImplementedError, match=r"gfx950.*backend 'emulated'.*backend 'npu'"):
        rocm.RocmBackend()


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"dual_scale": True, "scale_rule": "floor", "w4a8": False}, "mxfp4_dualscale is not supported"),
        ({"dual_scale": False, "scale_rule": "uos", "w4a8": False}, "mxfp4_scale_alg=2"),
        ({"dual_scale": False, "scale_rule": "floor", "w4a8": True}, "W4A8 fallback"),
    ],
)
def test_what_aiter_cannot_run_is_refused_naming_alternatives(rocm_backend, fake_aiter, kw, match):
    with pytest.raises(NotImplementedError, match=rf"blocks\.0\.x: {match}.*'emulated'.*'npu'"):
        rocm_backend.check_supported("blocks.0.x", **kw)
    with pytest.raises(NotImplementedError, match=match):
        mirror(fake_aiter).check_supported("blocks.0.x", **kw)
    rocm_backend.check_supported("blocks.0.x", dual_scale=False, scale_rule="floor", w4a8=False)


def test_refusals_at_every_entry_point(vllm_env, rocm_backend, fake_aiter):
    w, b, x = weights(46)
    with pytest.raises(NotImplementedError, match="mxfp4_scale_alg=2"):
        rocm_backend.quantize_weight(w, "uos")
    with pytest.raises(NotImplementedError, match="mxfp4_dualscale"):
        rocm_backend.quantize_weight_dualscale(w)
    spec = MxLayerSpec("p", True, "floor", K, N, False)
    with pytest.raises(NotImplementedError, match="mxfp4_dualscale"):
        rocm_backend.prepare(torch.nn.Module(), spec)
    layer = build(vllm_env, {"method": "mxfp4", "backend": "emulated"}, rocm_backend, {"weight": w}, bias=b)
    with pytest.raises(NotImplementedError, match="W4A8"):
        rocm_backend.linear(layer, layer._mx_spec, x.reshape(-1, K), None, a8=True)


# ------------------------------------------------------------------------------- wrong calls caught


def test_a_missing_weight_shuffle_is_caught(vllm_env, rocm_backend, fake_aiter, monkeypatch):
    monkeypatch.setattr(rocm_backend, "_shuffle_weight", lambda w, layout: w)
    w, b, x = weights(47)
    layer = build(vllm_env, {"method": "mxfp4", "backend": "emulated"}, rocm_backend, {"weight": w}, bias=b)
    with pytest.raises(FakeAiterError, match="shuffle_weight"):
        run(vllm_env, layer, x)


def test_unshuffled_weight_scales_give_wrong_numbers(vllm_env, rocm_backend, fake_aiter, monkeypatch):
    """Scales padded to AITER's shape but not permuted pass every shape check, and are still caught."""
    monkeypatch.setattr(
        rocm_backend,
        "_e8m0_shuffle",
        lambda s: torch.nn.functional.pad(
            s.view(torch.uint8), (0, 8 - s.shape[1] % 8 if s.shape[1] % 8 else 0, 0, -s.shape[0] % 256)
        ).view(s.dtype),
    )
    w, b, x = weights(48)
    spec = {"method": "mxfp4", "backend": "emulated"}
    rocm, emu = both(vllm_env, rocm_backend, fake_aiter, spec, {"weight": w}, bias=b)
    assert not torch.equal(run(vllm_env, rocm, x), run(vllm_env, emu, x))


def test_unshuffled_activation_scales_are_caught(fake_aiter):
    x = torch.randn(5, 128).to(torch.bfloat16)
    quant = fake_aiter.get_hip_quant(fake_aiter.aiter.QuantType.per_1x32)
    x_q, plain = quant(x, shuffle=False)
    w_q, w_s = quant(torch.randn(32, 128).to(torch.bfloat16), shuffle=False)
    w_sh = fake_aiter.shuffle_weight(w_q)
    w_s_sh = shuffle_scale_layout(w_s.view(torch.uint8)).view(w_s.dtype)
    with pytest.raises(FakeAiterError, match="A_scale must be the padded shuffled E8M0 layout"):
        fake_aiter.aiter.gemm_a4w4(x_q, w_sh, plain, w_s_sh)


def test_a_layer_moves_between_backends(vllm_env, rocm_backend, fake_aiter, npu_backend):
    """A backend that adopted the weight's storage hands it back canonical to the next one."""
    w, b, x = weights(49)
    data, scale = quantize_mx(w)
    spec = {"method": "mxfp4", "is_checkpoint_mxfp4_serialized": True, "backend": "emulated"}
    layer = build(vllm_env, spec, rocm_backend, {"weight": data, "weight_scale": scale}, bias=b)
    assert not torch.equal(layer.weight.data, data)  # AITER's shuffled bytes
    outs = []
    for backend in (npu_backend, EmulatedBackend(compute_dtype="float32")):
        layer.quant_method.backend = backend
        backend.prepare(layer, layer._mx_spec)
        assert torch.equal(layer.weight.data, data)
        outs.append(run(vllm_env, layer, x))
    assert torch.equal(*outs)
