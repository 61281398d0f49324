"""Proof against the producer: the merged w4a4f4 checkpoint, loaded by vLLM-Omni's own Wan2.2 loader on
the CPU platform, computes what msModelSlim's own quantized model computes (issue #15).

The reference is the same vLLM-Omni transformer built from the BF16 original, with every Linear that
msModelSlim quantized computed by msModelSlim's in-memory fake-quant module
(``W4A4MXDynamicPerBlockFakeQuantLinear`` / ``W8A8MXDynamicPerBlockFakeQuantLinear``, taken from the
recipe run after ``quant``): its decoded weight and its ``F.linear``. Attention runs in BF16 on both
sides (the merge leaves QuaRot and FA3 out; msModelSlim's attention wrappers are not part of its
Linears). Our side runs the emulated kernels with their default rules and float32 GEMMs.

Two comparisons:

- msModelSlim's model with ONLY its activation quantization replaced by the hardware rules
  (``tests/support/msmodelslim_hw_rules.py``, an independent float64 transcription of
  ``tests/formats/reference.py``: OCP FLOOR exponent, E2M1 / E4M3 round to nearest even, saturation at
  6 / 448). What is left is the order of float32 accumulation: every dequantized operand is exact in
  BF16, so products are exact in float32 and the sums differ by at most a few float32 ulps (k * 2^-24
  relative, k <= 1024 here), about 2^-14 of a BF16 step; that can flip the BF16 rounding of a result by
  one step, rarely. So each Linear may be at most one BF16 step away (and almost all equal), and the
  transformer output, where a flipped rounding propagates, within one BF16 step at the output's scale
  (max |diff| <= 2^-8 max |out|). Measured: every Linear and the whole transformer bit-identical, for
  both merges.
- msModelSlim's own simulation unpatched ("what users get against what msModelSlim reports"): its
  rules differ (ties half away from zero, the MXFP4 exponent ``floor(log2(amax * 8/7 + 9.6e-7)) - 2``
  computed in BF16, the MXFP8 clamp at 480), so only a cosine similarity: 0.99990 (0.99994 with the
  MXFP8 blocks kept BF16), closer to it than msModelSlim's model is to BF16 (0.99975 / 0.99987).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support import msmodelslim_hw_rules as hw
from tests.support.layers import build_expert, env_vars, forward, quantized_layers

from ..formats import reference

pytestmark = pytest.mark.omni


def _ours(vllm_env, merged):
    """The merged checkpoint through vLLM-Omni's loader: emulated kernels with their default (hardware)
    rules, float32 GEMMs."""
    with env_vars(VLLM_OMNI_MXFP4_EMULATED_COMPUTE="float32"):
        return build_expert(vllm_env, merged, None)


def _reference(vllm_env, scenario, merged_name):
    """vLLM-Omni's transformer from the BF16 original with msModelSlim's Linears installed, and those."""
    reference = build_expert(vllm_env, scenario.original, None)
    linears = scenario.linears["transformer"]
    if merged_name == "w4a4f4-bf16":  # blocks 0-4 are the BF16 original on both sides
        linears = {k: v for k, v in linears.items() if k.startswith("blocks.5.")}
    return reference, linears


def _cos(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.mark.parametrize("merged_name", ["w4a4f4", "w4a4f4-bf16"])
def test_transformer_output_equals_msmodelslims_model(vllm_env, merged_recipes, w4a4f4_export, merged_name):
    ours = _ours(vllm_env, merged_recipes[merged_name][0])
    expected_quantized = 48 if merged_name == "w4a4f4" else 8  # runtime Linears (Q/K/V fused)
    assert len(quantized_layers(ours)) == expected_quantized
    seen = hw.capture(quantized_layers(ours))
    got = forward(vllm_env, ours)
    reference, linears = _reference(vllm_env, w4a4f4_export, merged_name)
    layers = hw.msmodelslim_layers(reference, linears)
    assert len(layers) == expected_quantized
    hw.install(reference, layers)
    want = forward(vllm_env, reference)
    with hw.hardware_activations(list(linears.values())):
        hardware = forward(vllm_env, reference)
        with vllm_env.context(), torch.no_grad():
            per_layer = {
                n: hw.bf16_steps(out, hw.first(reference.get_submodule(n)(x))) for n, (x, out) in seen.items()
            }
    bf16 = forward(vllm_env, build_expert(vllm_env, w4a4f4_export.original, None))
    hw.assert_within_accumulation(per_layer, got, hardware)
    # msModelSlim's own simulation (its rules): what users get against what msModelSlim reports.
    assert _cos(got, want) >= 0.9999
    assert 1 - _cos(got, want) < 0.5 * (1 - _cos(want, bf16))


def _tie_rows(g: torch.Generator) -> torch.Tensor:
    """bf16 rows of 64: E2M1 ties in blocks whose maximum (7, saturating to 6) gives scale 1, E4M3 ties
    (1.0625, 232) in blocks whose maximum (464, saturating to 448) gives scale 1, zeros, a maximum just
    below a power of two (6.97), subnormal and Gaussian rows; each row times a power of two, signs random."""
    fp4 = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.97, 0.0])
    fp8 = torch.tensor([1.0625, 232.0, 240.0, 0.0078125, 0.0])
    x = torch.cat(
        [
            fp4[torch.randint(len(fp4), (3, 64), generator=g)],
            fp8[torch.randint(len(fp8), (3, 64), generator=g)],
        ]
    )
    x[:3, ::32], x[3:, ::32] = 7.0, 464.0
    x = x * torch.exp2(torch.randint(-8, 8, (6, 1), generator=g).double())
    x = torch.cat([x, torch.randn(1, 64, generator=g) * 1e-39, torch.randn(1, 64, generator=g) * 3])
    return (x * torch.where(torch.rand(8, 64, generator=g) < 0.5, -1.0, 1.0)).to(torch.bfloat16)


@pytest.mark.parametrize("elem", ["fp4", "fp8"])
def test_hardware_rule_helper_equals_reference(elem):
    """The patch helper's vectorised rule gives reference.py's values, element for element."""
    x = _tie_rows(torch.Generator().manual_seed(5))
    got = hw.fake_quantize(x, elem)
    for row, out in zip(x.double().tolist(), got.tolist()):
        values, scales = reference.quantize_row(row, "floor", elem)
        if elem == "fp4":
            want = [reference.dequant_value(c, scales[i // 32]) for i, c in enumerate(values)]
        else:
            want = [v * 2.0 ** (scales[i // 32] - 127) for i, v in enumerate(values)]
        torch.testing.assert_close(torch.tensor(out), torch.tensor(want), rtol=0, atol=0, equal_nan=True)


def test_hardware_dualscale_helper_equals_reference():
    """The same for the dual-level rule, on rows of 1024 (two 512-element coarse blocks)."""
    g = torch.Generator().manual_seed(6)
    x = torch.cat([_tie_rows(g).repeat(1, 16), (torch.randn(4, 1024, generator=g) * 5).to(torch.bfloat16)])
    got = hw.fake_quantize_dualscale(x)
    for row, out in zip(x.double().tolist(), got.tolist()):
        codes, scales, l0s = reference.dualscale_row(row)
        exact = [reference.dequant_value(c, scales[i // 32]) * l0s[i // 512] for i, c in enumerate(codes)]
        want = torch.tensor(exact, dtype=torch.float64).float()
        torch.testing.assert_close(torch.tensor(out), want, rtol=0, atol=0, equal_nan=True)
