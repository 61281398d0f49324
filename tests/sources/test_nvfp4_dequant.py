"""NVFP4 dequantization: exact against an independent reference, bit for bit against each producer.

The producers dequantize themselves: ModelOpt (fixtures it wrote, tests/support/nvfp4/producers),
comfy-kitchen and compressed-tensors (run here). Every producer rounds ``s * g`` first, so they
are compared with ``order="scale_first"``; the default ``exact`` order is checked against the
float64 reference. Zeros are compared without their sign (ModelOpt decodes code 8 as +0).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.nvfp4 import reference
from tests.support.nvfp4.checkpoints import MODELOPT_FIXTURES, write_checkpoint
from tests.support.nvfp4.producers.comfy import comfy_layer, marker_tensor
from tests.support.nvfp4.producers.compressed import ct_config, ct_layer
from vllm_omni_mxfp4.formats.nvfp4 import Nvfp4Weight, dequantize_nvfp4, e4m3_to_float
from vllm_omni_mxfp4.sources.nvfp4 import detect_nvfp4, load_nvfp4_weight

FIXTURES = MODELOPT_FIXTURES


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical float32 tensors, except that +0 and -0 count as equal."""
    a = torch.where(a == 0, torch.zeros_like(a), a)
    b = torch.where(b == 0, torch.zeros_like(b), b)
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def random_weight(n: int, k: int, g: float, seed: int = 0, divides: bool = False) -> Nvfp4Weight:
    """Random codes, random finite E4M3 scales (all magnitudes), global ``g``."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale_bytes = torch.randint(0, 0x7F, (n, k // 16), dtype=torch.uint8, generator=gen)
    return Nvfp4Weight(
        codes, scale_bytes.view(torch.float8_e4m3fn), torch.tensor(g, dtype=torch.float32), divides
    )


def reference_dequant(w: Nvfp4Weight, order: str) -> torch.Tensor:
    """Element by element with :mod:`tests.support.nvfp4.reference`."""
    n, k = w.shape
    scales = w.scales.view(torch.uint8).tolist()
    codes = w.codes.tolist()
    g = float(w.global_scale)
    out = [
        [
            reference.nvfp4_element(
                (codes[r][c // 2] >> (4 * (c % 2))) & 0xF, scales[r][c // 16], g, order, w.global_divides
            )
            for c in range(k)
        ]
        for r in range(n)
    ]
    return torch.tensor(out, dtype=torch.float32)


def test_e4m3_decode_matches_the_bit_layout_for_all_256_bytes() -> None:
    got = e4m3_to_float(torch.arange(256, dtype=torch.uint8))
    want = torch.tensor([reference.e4m3_value(b) for b in range(256)], dtype=torch.float32)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite], want[finite])


@pytest.mark.parametrize("order", ["exact", "scale_first"])
@pytest.mark.parametrize("g, divides", [(0.3333, False), (7.77e-5, False), (655.371, True), (2.0**-7, False)])
def test_dequant_equals_the_reference(order: str, g: float, divides: bool) -> None:
    w = random_weight(8, 64, g, seed=int(g * 1e4) % 97, divides=divides)
    assert same_values(dequantize_nvfp4(w, order=order), reference_dequant(w, order))


def test_orders_differ_by_at_most_one_ulp_only_where_q_is_not_a_power_of_two() -> None:
    w = random_weight(64, 256, 0.3333, seed=3)
    exact = dequantize_nvfp4(w)
    first = dequantize_nvfp4(w, order="scale_first")
    ulps = (exact.view(torch.int32) - first.view(torch.int32)).abs()
    differ = ulps != 0
    assert differ.any(), "a non power-of-two global scale must show the rounding-order difference"
    assert int(ulps[exact != 0].max()) <= 1
    mags = torch.stack((w.codes & 7, w.codes >> 4 & 7), dim=-1).reshape(exact.shape)
    assert set(mags[differ].unique().tolist()) <= {3, 5, 7}  # |q| = 1.5, 3, 6


def test_orders_agree_for_a_power_of_two_global_scale() -> None:
    w = random_weight(32, 128, 2.0**-9, seed=4)
    assert same_values(dequantize_nvfp4(w), dequantize_nvfp4(w, order="scale_first"))


def test_per_row_global_scale_applies_row_by_row() -> None:
    w = random_weight(6, 32, 1.0, seed=5)
    g = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=torch.float32)
    rows = Nvfp4Weight(w.codes, w.scales, g)
    out = dequantize_nvfp4(rows)
    for r in range(6):
        one = Nvfp4Weight(w.codes[r : r + 1], w.scales[r : r + 1], g[r].clone())
        assert same_values(out[r : r + 1], dequantize_nvfp4(one))


def test_bad_inputs_name_the_layer() -> None:
    w = random_weight(4, 32, 1.0)
    with pytest.raises(ValueError, match=r"attn\.to_q.*expected \(4, 2\)"):
        Nvfp4Weight(w.codes, w.scales[:, :1], w.global_scale, name="attn.to_q")
    with pytest.raises(ValueError, match=r"ffn.*finite and > 0"):
        Nvfp4Weight(w.codes, w.scales, torch.tensor(0.0), name="ffn")
    with pytest.raises(TypeError, match=r"proj.*float32"):
        Nvfp4Weight(w.codes, w.scales, torch.tensor(1.0, dtype=torch.float64), name="proj")
    with pytest.raises(ValueError, match="order must be one of"):
        dequantize_nvfp4(w, order="fast")


@pytest.mark.parametrize("export", ["nvfp4", "swizzled"])
def test_modelopt_own_dequant_is_reproduced_bit_for_bit(export: str) -> None:
    """ModelOpt's ``NVFP4QTensor.dequantize`` (in dequant.safetensors) of its own exports, one flat
    (linear scales) and one post-processed (128x4 swizzled scales, header metadata)."""
    truth = load_file(FIXTURES / "dequant.safetensors")
    checkpoint = detect_nvfp4(FIXTURES / export)
    tensors = load_file(FIXTURES / export / "diffusion_pytorch_model.safetensors")
    names = checkpoint.names("requantize")
    assert sorted(truth) == names
    for name in names:
        w = load_nvfp4_weight(checkpoint.layers[name], tensors.__getitem__)
        assert same_values(dequantize_nvfp4(w, order="scale_first"), truth[name]), name


def test_comfy_kitchen_own_dequant_is_reproduced_bit_for_bit(tmp_path: Path) -> None:
    """comfy-kitchen quantizes (high nibble = even element, swizzled scales, a row count that is
    not a multiple of 128) and dequantizes; we read its checkpoint through detection."""
    ck = pytest.importorskip("comfy_kitchen")
    w = torch.randn(192, 320, generator=torch.Generator().manual_seed(6)).bfloat16()
    tensors = comfy_layer("blocks.0.ffn", w)
    truth = ck.dequantize_nvfp4(
        tensors["blocks.0.ffn.weight"],
        tensors["blocks.0.ffn.weight_scale_2"],
        tensors["blocks.0.ffn.weight_scale"],
        torch.float32,
    )
    checkpoint = detect_nvfp4(write_checkpoint(tmp_path / "comfy", tensors))
    layer = checkpoint.layers["blocks.0.ffn"]
    assert (checkpoint.producer, layer.nibble_order, layer.scale_layout) == ("comfy", "high_even", "swizzled")
    ours = dequantize_nvfp4(load_nvfp4_weight(layer, tensors.__getitem__), order="scale_first")
    assert same_values(ours, truth)


def test_compressed_tensors_own_dequant_is_reproduced_bit_for_bit(tmp_path: Path) -> None:
    """compressed-tensors packs (low nibble = even) with a global *divisor* and dequantizes."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(7))
    packed = {f"blocks.0.attn1.to_q.{k}": v for k, v in ct_layer(w).items()}
    q = unpack_fp4_from_uint8(packed["blocks.0.attn1.to_q.weight_packed"], 96, 256, dtype=torch.float32)
    truth = dequantize(
        x_q=q,
        scale=packed["blocks.0.attn1.to_q.weight_scale"].to(torch.float32),
        global_scale=packed["blocks.0.attn1.to_q.weight_global_scale"],
        dtype=torch.float32,
    )
    checkpoint = detect_nvfp4(write_checkpoint(tmp_path / "ct", packed, ct_config(ignore=["proj_out"])))
    layer = checkpoint.layers["blocks.0.attn1.to_q"]
    assert (checkpoint.producer, layer.global_divides, layer.scale_layout) == (
        "compressed-tensors",
        True,
        "linear",
    )
    ours = dequantize_nvfp4(load_nvfp4_weight(layer, packed.__getitem__), order="scale_first")
    assert same_values(ours, truth)


def _fp8_layer_values(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 codes times their scale, from the bit fields and Python floats (independent of the
    package): float32 per tensor or per row, or uint8 E8M0 codes per 32 inputs."""
    codes = weight.view(torch.uint8).tolist()
    n, k = weight.shape
    if scale.dtype == torch.uint8:
        factor = [[2.0 ** (c - 127) for c in row] for row in scale.tolist()]
        per = [[factor[r][c // 32] for c in range(k)] for r in range(n)]
    else:
        s = scale.reshape(-1).tolist()
        per = [[s[0] if len(s) == 1 else s[r]] * k for r in range(n)]
    return torch.tensor(
        [[reference.e4m3_value(codes[r][c]) * per[r][c] for c in range(k)] for r in range(n)],
        dtype=torch.float64,
    )


@pytest.mark.parametrize("form", ["tensor", "row", "e8m0"])
def test_fp8_layers_of_a_comfy_checkpoint_load_and_convert_with_their_scale_form(
    tmp_path: Path, form
) -> None:
    """An FP8 layer next to NVFP4 ones is dequantized to BF16 by the engine's weight stream and by
    ``convert`` alike, whatever form its scale has: Comfy's ``mxfp8`` layers carry E8M0 codes per
    32 inputs ``(N, K/32)``, which read as a per-row float scale would be silently wrong."""
    from vllm_omni_mxfp4.config import Mxfp4Config
    from vllm_omni_mxfp4.hooks.nvfp4_loading import PLAN_ATTR, Nvfp4Plan, convert_stream
    from vllm_omni_mxfp4.sources.nvfp4.dequant import dequantize_layer

    gen = torch.Generator().manual_seed(11)
    n, k = 64, 256
    weight = torch.randint(0, 0x7F, (n, k), dtype=torch.uint8, generator=gen)
    weight[weight == 0x7F] = 0x10
    weight = weight.view(torch.float8_e4m3fn)
    scale = {
        "tensor": torch.tensor(0.03125, dtype=torch.float32),
        "row": torch.rand(n, generator=gen) * 0.1 + 0.01,
        "e8m0": torch.randint(110, 135, (n, k // 32), dtype=torch.uint8, generator=gen),
    }[form]
    fmt = "mxfp8" if form == "e8m0" else "float8_e4m3fn"
    tensors = comfy_layer("blocks.0.ffn.net.0.proj", torch.randn(128, 256, generator=gen).bfloat16())
    tensors |= {
        "blocks.0.ffn.net.2.weight": weight,
        "blocks.0.ffn.net.2.weight_scale": scale,
        "blocks.0.ffn.net.2.comfy_quant": marker_tensor({"format": fmt}),
    }
    directory = write_checkpoint(tmp_path / "comfy", tensors)
    checkpoint = detect_nvfp4(directory)
    layer = checkpoint.layers["blocks.0.ffn.net.2"]
    assert layer.action == "dequantize"
    want = _fp8_layer_values(weight, scale).float().bfloat16()  # float32 products, rounded once more

    assert torch.equal(dequantize_layer(layer, tensors.__getitem__, torch.bfloat16), want)
    plan = Nvfp4Plan.of(
        "transformer", directory, checkpoint, Mxfp4Config(is_checkpoint_mxfp4_serialized=True)
    )
    model = torch.nn.Module()
    setattr(model, PLAN_ATTR, plan)
    streamed = dict(convert_stream(model, [(n_, t) for n_, t in tensors.items() if "net.2" in n_]))
    assert torch.equal(streamed["blocks.0.ffn.net.2.weight"], want)
