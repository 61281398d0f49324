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
    layer, prepared, _, _, data = _prepared(plain_layer, AiterSingle(), n=256)
    assert not torch.equal(layer.weight.data, data)  # the parameter holds AITER's shuffled bytes
    assert prepared.weight.is_shuffled
    layer, prepared, _, _, data = _prepared(plain_layer, AiterSingle(), k=80, n=40)
    assert prepared.weight.shape == (256, 64)  # (roundup(N, 256): the asm tile width, roundup(K, 64) / 2)
    assert torch.equal(layer.weight.data, data)  # other shape: not adopted


@pytest.mark.parametrize("n", [16, 96, 400])
def test_n_is_padded_to_the_asm_tile_width_and_no_bias_reaches_the_gemm(vllm_env, fake_aiter, n):
    """N % 16 is enough for the shuffle but not for the asm gemm_a4w4 (tiles 128/256): the kernel
    pads N to 256 and adds the bias itself (the asm kernel would drop it)."""
    w, b, x = weights(48, n=n)
    layer = build(vllm_env, {"method": "mxfp4", "backend": "rocm"}, {"weight": w}, n=n, bias=b)
    out = run(vllm_env, layer, x)
    _, (a, bw, _, _), kwargs = [c for c in fake_aiter.calls if c[0] == "gemm_a4w4"][-1]
    assert bw.shape[0] % 256 == 0 and kwargs["bias"] is None and kwargs["dtype"] == torch.bfloat16
    assert a.dtype == torch.float4_e2m1fn_x2 and out.shape[-1] == n
    no_bias = build(
        vllm_env, {"method": "mxfp4", "backend": "rocm"}, {"weight": w}, n=n, bias=torch.zeros_like(b)
    )
    assert torch.equal(out, (run(vllm_env, no_bias, x).float() + b.float()).to(out.dtype))


def test_the_fake_gemm_rejects_what_the_asm_kernel_rejects(fake_aiter):
    aiter = fake_aiter.aiter
    quant = aiter.get_hip_quant(aiter.QuantType.per_1x32)
    x_q, x_s = quant(torch.randn(4, 128).to(torch.bfloat16), shuffle=True)
    shuffle_weight = fake_aiter.modules["aiter.ops.shuffle"].shuffle_weight

    def operands(n):
        w_q, w_s = quant(torch.randn(n, 128).to(torch.bfloat16), shuffle=True)
        return x_q, shuffle_weight(w_q, layout=(16, 16)), x_s, w_s

    aiter.gemm_a4w4(*operands(256), dtype=torch.bfloat16)  # the valid call
    for n in (16, 128 + 16):  # N % 16 satisfies the shuffle, not the asm tile table
        with pytest.raises(FakeAiterError, match=f"cannot get heuristic kernel! N={n}"):
            aiter.gemm_a4w4(*operands(n), dtype=torch.bfloat16)
    for dtype in (torch.float16, torch.float32):
        with pytest.raises(FakeAiterError, match="only support BFloat16 output"):
            aiter.gemm_a4w4(*operands(256), dtype=dtype)
    a, b, a_s, b_s = operands(256)
    with pytest.raises(FakeAiterError, match="Unsupported input_type: torch.uint8"):
        aiter.gemm_a4w4(a.view(torch.uint8), b, a_s, b_s, dtype=torch.bfloat16)
    with pytest.raises(FakeAiterError, match="drops it"):
        aiter.gemm_a4w4(a, b, a_s, b_s, bias=torch.zeros(1, 256), dtype=torch.bfloat16)


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
    w_q, w_s = quant(torch.randn(256, 128).to(torch.bfloat16), shuffle=False)
    w_sh = fake_aiter.shuffle_weight(w_q)
    w_s_sh = shuffle_scale_layout(w_s.view(torch.uint8)).view(w_s.dtype)
    with pytest.raises(FakeAiterError, match="A_scale must be the padded shuffled E8M0 layout"):
        fake_aiter.aiter.gemm_a4w4(x_q, w_sh, plain, w_s_sh)


def test_the_probe_table_follows_the_scale_rules():
    """RULE_BY_PROBE_CODES is what formats' scale rules give the probe maxima (and the independent
    reference agrees): the probes tell every AITER-relevant rule apart, so a rule change in formats
    or a typo in the table cannot go unnoticed."""
    from tests.formats import reference as ref
    from vllm_omni_mxfp4.formats import shared_exponent_codes
    from vllm_omni_mxfp4.kernels.emulated_rocm import AITER_RULES
    from vllm_omni_mxfp4.kernels.rocm import PROBE_AMAX, RULE_BY_PROBE_CODES

    amax = torch.tensor(PROBE_AMAX, dtype=torch.float32)
    by_rule = {rule: tuple(shared_exponent_codes(amax, rule).tolist()) for rule in AITER_RULES}
    assert {codes: rule for rule, codes in by_rule.items()} == RULE_BY_PROBE_CODES
    assert len(set(by_rule.values())) == len(AITER_RULES)  # every rule has its own signature
    for rule, codes in by_rule.items():
        assert codes == tuple(ref.scale_code(a, rule) for a in PROBE_AMAX), rule
