"""Proof against the producer: the merged w4a4f4 checkpoint, loaded by vLLM-Omni's own Wan2.2 loader on
the CPU platform, computes what msModelSlim's own quantized model computes (issue #15).

The reference is the same vLLM-Omni transformer built from the BF16 original, with every Linear that
msModelSlim quantized computed by msModelSlim's in-memory fake-quant module
(``W4A4MXDynamicPerBlockFakeQuantLinear`` / ``W8A8MXDynamicPerBlockFakeQuantLinear``, taken from the
recipe run after ``quant``): msModelSlim's own activation quantization, its decoded weight and its
``F.linear``. Attention runs in BF16 on both sides (the merge leaves QuaRot and FA3 out; msModelSlim's
attention wrappers are not part of its Linears).

Our side runs the emulated kernels with float32 GEMMs; the MXFP4 layers use the EVEN activation
exponent rule, which is msModelSlim's ``floor(log2(amax * 8/7)) - 2`` (``calculate_mxfp4_qparam``).
Activations are where the two sides may differ: msModelSlim's simulation rounds element magnitudes
half away from zero (``floor(|x| + 0.5)`` in ``mxfp4_quantize``), the OCP / NPU rule to nearest even.
So each Linear is compared on inputs that need no rounding (every element on the format's grid, every
block's maximum a power of two that every rule gives the same exponent): there the outputs agree up to
BF16 rounding of the result. The whole transformer, whose activations are not on a grid, agrees to a
cosine similarity of 0.9999 and much closer than either is to BF16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.layers import build_expert, env_vars, forward, quantized_layers

pytestmark = pytest.mark.omni

# vLLM-Omni runtime Linear (suffix inside a block) -> the original Wan Linears msModelSlim quantized.
RUNTIME_TO_ORIGINAL = {
    "attn1.to_qkv": ("self_attn.q", "self_attn.k", "self_attn.v"),
    "attn1.to_out": ("self_attn.o",),
    "attn2.to_q": ("cross_attn.q",),
    "attn2.to_k": ("cross_attn.k",),
    "attn2.to_v": ("cross_attn.v",),
    "attn2.to_out": ("cross_attn.o",),
    "ffn.net_0.proj": ("ffn.0",),
    "ffn.net_2": ("ffn.2",),
}


def _install_msmodelslim(model, linears: dict[str, torch.nn.Module]) -> int:
    """Let msModelSlim's fake-quant modules compute every Linear it quantized; returns how many."""
    from vllm.model_executor.layers.linear import LinearBase

    installed = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, LinearBase) or not name.startswith("blocks."):
            continue
        block, suffix = name.split(".", 2)[1], name.split(".", 2)[2]
        modules = [linears.get(f"blocks.{block}.{o}") for o in RUNTIME_TO_ORIGINAL[suffix]]
        if any(m is None for m in modules):
            continue

        def run(x, modules=modules, return_bias=layer.return_bias):
            with torch.no_grad():
                out = torch.cat([m(x) for m in modules], dim=-1)
            return (out, None) if return_bias else out

        layer.forward = run
        installed += 1
    return installed


def _ours(vllm_env, merged, *, even: bool = True):
    """The merged checkpoint through vLLM-Omni's loader (emulated kernels, float32 GEMMs); with
    ``even`` the MXFP4 layers use the EVEN activation rule (the ROCm-mirroring kernel)."""
    from vllm_omni_mxfp4.config import Precision
    from vllm_omni_mxfp4.kernels.emulated_rocm import EmulatedAiterSingle

    with env_vars(VLLM_OMNI_MXFP4_EMULATED_COMPUTE="float32"):
        model = build_expert(vllm_env, merged, None)
    kernel = EmulatedAiterSingle(rule="even", compute_dtype="float32")
    for layer in quantized_layers(model).values() if even else ():
        if layer.quant_method.route.precision is not Precision.W8A8:
            layer.quant_method.use_kernel(layer, kernel)
    return model


def _bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many BF16 steps (ulps at the larger magnitude) two BF16 tensors are apart, elementwise."""
    top = torch.maximum(a.abs(), b.abs()).double().clamp_min(2.0**-126)
    return ((a.double() - b.double()).abs() / torch.exp2(torch.floor(torch.log2(top)) - 7)).round()


def _cos(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.mark.parametrize("merged_name", ["w4a4f4", "w4a4f4-bf16"])
def test_transformer_output_equals_msmodelslims_model(vllm_env, merged_recipes, w4a4f4_export, merged_name):
    ours = _ours(vllm_env, merged_recipes[merged_name][0])
    expected_quantized = 48 if merged_name == "w4a4f4" else 8  # runtime Linears (Q/K/V fused)
    assert len(quantized_layers(ours)) == expected_quantized
    reference = build_expert(vllm_env, w4a4f4_export.original, None)
    linears = w4a4f4_export.linears["transformer"]
    if merged_name == "w4a4f4-bf16":  # blocks 0-4 are the BF16 original on both sides
        linears = {k: v for k, v in linears.items() if k.startswith("blocks.5.")}
    assert _install_msmodelslim(reference, linears) == expected_quantized
    bf16 = forward(vllm_env, build_expert(vllm_env, w4a4f4_export.original, None))
    got, want = forward(vllm_env, ours), forward(vllm_env, reference)
    steps = _bf16_steps(got, want)
    print(
        f"{merged_name}: ours vs msModelSlim: max {steps.max().item():.0f} BF16 steps, "
        f"{(steps == 0).double().mean().item():.4f} equal, cos {_cos(got, want):.7f}; "
        f"msModelSlim vs BF16: {(want == bf16).double().mean().item():.4f} equal, cos {_cos(want, bf16):.7f}"
    )
    assert _cos(got, want) >= 0.9999
    assert 1 - _cos(got, want) < 0.5 * (1 - _cos(want, bf16))


# Element values exactly on each format's grid, and the maximum every 32-block holds (2^2 for E2M1,
# 2^8 for E4M3: the top exponent of the element format, so every scale rule gives exponent 0).
GRIDS = {
    "mxfp4": ((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0), 4.0),
    "mxfp8": ((0.0, 0.125, 1.0, 1.5, 2.0, 3.5, 8.0, 13.0, 64.0, 96.0, 208.0, 256.0), 256.0),
}


def _grid_input(rows: int, k: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """Activations that no MX quantizer rounds: grid values times a power of two per 32-block."""
    values, top = GRIDS[kind]
    table = torch.tensor(values)
    x = table[torch.randint(len(values), (rows, k), generator=g)]
    x = x * torch.where(torch.rand(rows, k, generator=g) < 0.5, -1.0, 1.0)
    x[:, ::32] = top
    scale = torch.exp2(torch.randint(-4, 3, (rows, k // 32), generator=g).double())
    return (x.double() * scale.repeat_interleave(32, dim=1)).to(torch.bfloat16)


@pytest.mark.parametrize("kind", ["mxfp8", "mxfp4"])
def test_each_linear_equals_msmodelslims_on_exact_inputs(vllm_env, merged_recipes, w4a4f4_export, kind):
    """Each quantized Linear alone, on inputs no quantizer rounds (so the default OCP rule applies):
    at most one BF16 step apart, the rounding of the result."""
    ours = _ours(vllm_env, merged_recipes["w4a4f4"][0], even=False)
    linears = w4a4f4_export.linears["transformer"]
    g = torch.Generator().manual_seed(3)
    checked = 0
    for name, layer in quantized_layers(ours).items():
        block = int(name.split(".")[1])
        if (block < 5) != (kind == "mxfp8"):
            continue
        modules = [linears[f"blocks.{block}.{o}"] for o in RUNTIME_TO_ORIGINAL[name.split(".", 2)[2]]]
        x = _grid_input(7, modules[0].weight.shape[1], kind, g)
        with vllm_env.context(), torch.no_grad():
            got = layer(x)
            got = got[0] if isinstance(got, tuple) else got
            want = torch.cat([m(x) for m in modules], dim=-1)
        steps = _bf16_steps(got, want)
        assert steps.max() <= 1, (name, steps.max().item())
        assert (steps == 0).double().mean() > 0.9, name
        checked += 1
    assert checked == (40 if kind == "mxfp8" else 8)
