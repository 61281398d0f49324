"""msModelSlim's quantized Linears with only their activation quantization replaced by the hardware rules.

msModelSlim's in-memory fake-quant Linears (``W4A4MXDynamicPerBlockFakeQuantLinear``,
``W8A8MXDynamicPerBlockFakeQuantLinear``, ``W4A4MXDynamicDualScaleFakeQuantLinear``) simulate the
activation quantization with their own rules (``msmodelslim/ir/api/impl/mx_quantization.py``): element
ties rounded half away from zero, the MXFP4 exponent ``floor(log2(amax * 8/7 + 9.6e-7)) - 2``, the MXFP8
clamp at 480, the DualScale coarse scale ``amax / 6`` divided in float32. The NPU kernels, and so ours,
follow the OCP / ``npu_dynamic_mx_quant`` rules written in docs/kernels.md. :func:`hardware_activations`
runs msModelSlim's own forward unchanged (its weight dequantization, its ``F.linear`` and dtypes) and
swaps only the activation operand of that ``F.linear`` for the hardware rule's result on the same input;
the Linear's output is rounded to the input's dtype, as every kernel writes it (msModelSlim's DualScale
module returns float32, which a wrapper around it, ``svd_res``'s, would otherwise add to in float32).

The hardware rule here is a vectorised float64 transcription of ``tests/formats/reference.py`` (the
FLOOR scale rule, E2M1 / E4M3 round-to-nearest-even with saturation, the dual-level kernel's
``amax * float32(1/6)`` coarse scale and bf16 intermediate); it shares no code with the package, and
``tests/checkpoint/test_recipes_proof.py`` checks it against ``reference.py`` element for element.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

EMAX = {"fp4": 2, "fp8": 8}
MAXV = {"fp4": 6.0, "fp8": 448.0}
MANTISSA_BITS = {"fp4": 1, "fp8": 3}
MIN_EXPONENT = {"fp4": 0, "fp8": -6}


def _round_elements(y: torch.Tensor, elem: str) -> torch.Tensor:
    """float64 ``y`` rounded to nearest, ties to even, onto the E2M1 / E4M3 grid, saturated; signed."""
    a = y.abs()
    exponent = torch.floor(torch.log2(a.clamp_min(2.0**-60))).clamp_min(MIN_EXPONENT[elem])
    quantum = torch.exp2(exponent - MANTISSA_BITS[elem])
    q = torch.round(a.clamp_max(MAXV[elem]) / quantum) * quantum
    return torch.copysign(q, y)


def scale_codes(amax: torch.Tensor, elem: str) -> torch.Tensor:
    """E8M0 codes of the FLOOR (OCP) rule for float32 block maxima: float32 exponent field - emax, at
    least 0; 255 for a NaN or infinite maximum. float64 result."""
    a = amax.double()
    field = torch.where(a >= 2.0**-126, torch.floor(torch.log2(a.clamp_min(2.0**-126))) + 127, 0.0)
    codes = (field - EMAX[elem]).clamp_min(0)
    return torch.where(torch.isfinite(a), codes, 255.0)


def fake_quantize(x: torch.Tensor, elem: str, block: int = 32) -> torch.Tensor:
    """Quantize-dequantize along the last axis (a multiple of ``block``) with the FLOOR rule, float64."""
    blocks = x.double().reshape(*x.shape[:-1], -1, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    amax = torch.where(blocks.isnan().any(dim=-1, keepdim=True), torch.nan, amax)
    codes = scale_codes(amax, elem)
    y = _round_elements(blocks * torch.exp2(127 - codes), elem)
    y = torch.where(codes == 0, _round_elements(blocks * 0.0, elem), y)  # FLOOR: code 0 flushes
    out = torch.where(codes == 255, torch.nan, y * torch.exp2(codes - 127))
    return out.reshape(x.shape)


def fake_quantize_dualscale(x: torch.Tensor) -> torch.Tensor:
    """The dual-level kernel on bf16 ``x``: per 512, l0 = float32(amax * float32(1/6)); x / l0 rounded to
    bf16; MXFP4 (FLOOR) per 32; times l0 rounded once to float32. float32 result."""
    k = x.shape[-1]
    padded = torch.nn.functional.pad(x.float(), (0, -k % 512))  # zeros change no chunk's maximum
    chunks = padded.reshape(*x.shape[:-1], -1, 512)
    amax = chunks.abs().nan_to_num(nan=0.0, posinf=0.0).amax(dim=-1, keepdim=True)
    l0 = amax * torch.tensor(1 / 6, dtype=torch.float32)
    l0 = torch.where(l0 < 2.0**-126, 0.0, l0)
    t = torch.where(chunks == 0, chunks, (chunks / l0).to(torch.bfloat16).float())
    inner = fake_quantize(t, "fp4")
    return (inner * l0.double()).float().reshape(*x.shape[:-1], -1)[..., :k]


def _rule_of(module: torch.nn.Module):
    """The hardware activation rule for one of msModelSlim's fake-quant Linears, by class."""
    name = type(module).__name__
    if name == "W4A4MXDynamicPerBlockFakeQuantLinear":
        return lambda x: fake_quantize(x, "fp4")
    if name == "W8A8MXDynamicPerBlockFakeQuantLinear":
        return lambda x: fake_quantize(x, "fp8")
    if name == "W4A4MXDynamicDualScaleFakeQuantLinear":
        return fake_quantize_dualscale
    raise TypeError(f"{name} is not one of msModelSlim's MX fake-quant Linears this helper knows")


@contextlib.contextmanager
def hardware_activations(modules: list[torch.nn.Module]) -> Iterator[None]:
    """While active, ``modules`` (msModelSlim's fake-quant Linears) multiply msModelSlim's own weight
    by the hardware rule's quantized activation instead of msModelSlim's simulated one."""
    import msmodelslim.ir.w4a4_mx_dynamic as w4
    import msmodelslim.ir.w4a4_mx_dynamic_dualscale as dual
    import msmodelslim.ir.w8a8_mx_dynamic as w8

    current: dict[str, torch.Tensor] = {}

    class _Functional:
        """``torch.nn.functional`` for the IR modules, but ``linear`` takes the hardware activation."""

        def __getattr__(self, name):
            return getattr(torch.nn.functional, name)

        @staticmethod
        def linear(x, weight, bias=None):
            # DualScale hands float32 operands and its bf16 bias (msModelSlim's adapter runs under bf16
            # autocast); outside autocast the bias is widened, exactly.
            bias = None if bias is None else bias.to(x.dtype)
            return torch.nn.functional.linear(current["x"].to(x.dtype), weight, bias)

    def wrap(module):
        if "forward" in vars(module):
            raise ValueError(f"{type(module).__name__} already has its forward replaced")
        original, rule = module.forward, _rule_of(module)

        def forward(x):
            current["x"] = rule(x)
            # The dual-level GEMM writes the activation's dtype (bf16/fp16); msModelSlim's DualScale
            # module returns its float32 product, which matters where a wrapper adds to it (svd_res).
            return original(x).to(x.dtype)

        return original, forward

    saved = {id(m): wrap(m) for m in modules}
    functionals = {ir: ir.F for ir in (w4, w8, dual)}
    for m in modules:
        m.forward = saved[id(m)][1]
    for ir in functionals:
        ir.F = _Functional()
    try:
        yield
    finally:
        for ir, functional in functionals.items():
            ir.F = functional
        for m in modules:
            del m.forward  # the instance attribute set above; the class's forward shows again


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


def msmodelslim_layers(model, linears: dict[str, torch.nn.Module]) -> dict[str, list[torch.nn.Module]]:
    """The runtime Linears whose every part msModelSlim quantized, each with msModelSlim's modules."""
    from vllm.model_executor.layers.linear import LinearBase

    found = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, LinearBase) or not name.startswith("blocks."):
            continue
        block, suffix = name.split(".", 2)[1], name.split(".", 2)[2]
        modules = [linears.get(f"blocks.{block}.{o}") for o in RUNTIME_TO_ORIGINAL[suffix]]
        if all(m is not None for m in modules):
            found[name] = modules
    return found


def install(model: torch.nn.Module, modules_by_layer: dict[str, list[torch.nn.Module]]) -> None:
    """Let msModelSlim's fake-quant Linears compute the named vLLM Linears of ``model``: their outputs
    concatenated (a fused layer's parts in its order), in the input's dtype as the vLLM Linear returns."""
    for name, modules in modules_by_layer.items():
        layer = model.get_submodule(name)

        def run(x, modules=modules, return_bias=layer.return_bias):
            with torch.no_grad():
                out = torch.cat([m(x) for m in modules], dim=-1).to(x.dtype)
            return (out, None) if return_bias else out

        layer.forward = run


def first(output):
    """A vLLM Linear's output without its bias (``return_bias`` Linears return a pair)."""
    return output[0] if isinstance(output, tuple) else output


def capture(layers: dict[str, torch.nn.Module]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Hooks that record each of ``layers``' (input, output) during the next forward, by name."""
    seen = {}
    for name, layer in layers.items():

        def hook(module, args, output, name=name):
            seen[name] = (args[0].detach().clone(), first(output).clone())

        layer.register_forward_hook(hook)
    return seen


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many BF16 steps (ulps at the larger magnitude) two BF16 tensors are apart, elementwise."""
    top = torch.maximum(a.abs(), b.abs()).double().clamp_min(2.0**-126)
    return ((a.double() - b.double()).abs() / torch.exp2(torch.floor(torch.log2(top)) - 7)).round()


def assert_within_accumulation(
    per_layer: dict[str, torch.Tensor], got: torch.Tensor, want: torch.Tensor
) -> None:
    """The proofs' bound for float32 accumulation-order differences: each Linear (``per_layer``:
    :func:`bf16_steps` of its output) at most one BF16 step away and 99.9% of elements equal; the
    transformer output within one BF16 step at its scale (max |diff| <= 2^-8 max |out|), cosine 1 - 1e-6."""
    worst = max(steps.max().item() for steps in per_layer.values())
    equal = sum((s == 0).sum().item() for s in per_layer.values()) / sum(
        s.numel() for s in per_layer.values()
    )
    assert worst <= 1 and equal >= 0.999, f"per Linear: max {worst} BF16 steps, {equal:.5f} of elements equal"
    got, want = got.double().flatten(), want.double().flatten()
    rel = ((got - want).abs().max() / want.abs().max()).item()
    cosine = (got @ want / (got.norm() * want.norm())).item()
    assert rel <= 2.0**-8 and cosine >= 1 - 1e-6, (
        f"transformer: max|diff|/max|out| {rel:.2e}, cosine {cosine:.8f}"
    )
