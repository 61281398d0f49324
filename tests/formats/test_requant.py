"""NVFP4 -> MXFP4 requantization: rule codes against an independent reference, ``mse`` never worse
than the vendor rules, lossless round trips (ModelOpt's own MXFP4 -> NVFP4 cast, and constructed
power-of-two blocks), the layout of ``quantize_mx``, and the error report."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from tests.support.nvfp4 import reference
from tests.support.nvfp4.checkpoints import MODELOPT_FIXTURES
from vllm_omni_mxfp4.formats import dequantize_mx, pack_fp4, quantize_mx, unpack_fp4
from vllm_omni_mxfp4.formats.nvfp4 import Nvfp4Weight, dequantize_nvfp4
from vllm_omni_mxfp4.formats.requant import REQUANT_RULES
from vllm_omni_mxfp4.kernels.requant import requantize_nvfp4

FIXTURES = MODELOPT_FIXTURES
RULES = [r for r in REQUANT_RULES if r != "mse"]


def random_weight(n: int, k: int, seed: int, g: float = 0.0123) -> Nvfp4Weight:
    """Random NVFP4 with E4M3 scales spread over many octaves (so blocks reach every rule's edge)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.exp2(torch.rand(n, k // 16, generator=gen) * 14 - 7).to(torch.float8_e4m3fn)
    return Nvfp4Weight(codes, scales, torch.tensor(g, dtype=torch.float32))


def rows_of_blocks(x: torch.Tensor) -> list[list[float]]:
    """The 32-element blocks of float32 rows, as Python lists."""
    return [blk.tolist() for blk in x.reshape(-1, 32)]


@pytest.mark.parametrize("rule", [*RULES, "mse"])
def test_scale_codes_and_elements_equal_the_reference(rule: str) -> None:
    w = random_weight(16, 128, seed=1)
    result = requantize_nvfp4(w, rule)
    ref = dequantize_nvfp4(w)
    codes, elems = [], []
    for block in rows_of_blocks(ref):
        c = reference.mse_code(block) if rule == "mse" else reference.RULE_CODES[rule](max(map(abs, block)))
        codes.append(c)
        elems.extend(reference.mx_codes(block, c))
    assert result.scale.flatten().tolist() == codes
    assert torch.equal(result.data, pack_fp4(torch.tensor(elems, dtype=torch.uint8).reshape(16, 128)))


def test_rule_codes_on_golden_block_maxima() -> None:
    """Block maxima at each rule's edges (codes are biased E8M0; 6.0 * 2^k is where floor and rceil agree)."""
    golden = {
        6.0: {"floor": 127, "even": 127, "rceil": 127},
        7.0: {"floor": 127, "even": 128, "rceil": 128},
        4.0: {"floor": 127, "even": 127, "rceil": 127},
        3.9: {"floor": 126, "even": 127, "rceil": 127},
        3.4: {"floor": 126, "even": 126, "rceil": 127},
    }
    for amax, want in golden.items():
        block = torch.zeros(1, 32)
        block[0, 5] = amax
        for rule, code in want.items():
            assert int(quantize_mx(block, scale_rule=rule)[1]) == code, (amax, rule)
            assert reference.RULE_CODES[rule](amax) == code, (amax, rule)


def test_mse_is_never_worse_than_any_rule_on_any_block() -> None:
    w = random_weight(64, 512, seed=2)
    ref = dequantize_nvfp4(w).double()
    errors = {}
    for rule in REQUANT_RULES:
        r = requantize_nvfp4(w, rule)
        errors[rule] = ((dequantize_mx(r.data, r.scale).double() - ref) ** 2).reshape(-1, 32).sum(-1)
    for rule in RULES:
        assert bool((errors["mse"] <= errors[rule]).all()), rule
    assert bool((errors["mse"] < errors["floor"]).any()), "mse should beat floor somewhere on random data"


def test_mse_blocks_that_keep_the_floor_exponent_have_quantize_mx_floor_bytes() -> None:
    w = random_weight(32, 256, seed=3)
    ref = dequantize_nvfp4(w)
    mse = requantize_nvfp4(w, "mse")
    floor_data, floor_scale = quantize_mx(ref, scale_rule="floor")
    same_code = (mse.scale == floor_scale).repeat_interleave(16, dim=1)
    assert bool(same_code.any())
    assert torch.equal(mse.data[same_code], floor_data[same_code])


@pytest.mark.parametrize("rule", REQUANT_RULES)
def test_modelopt_lossless_cast_round_trips_to_the_original_mxfp4_bytes(rule: str) -> None:
    """ModelOpt's ``quantize_mxfp4_to_nvfp4_lossless`` of MXFP4 bytes requantizes to those bytes."""
    f = load_file(FIXTURES / "lossless.safetensors")
    w = Nvfp4Weight(f["weight"], f["weight_scale"], f["weight_scale_2"].reshape(()))
    result = requantize_nvfp4(w, rule)
    assert torch.equal(result.scale, f["mx_scale"])
    assert torch.equal(result.data, f["mx_weight"])
    assert result.error.exact_blocks == result.error.total_blocks == f["mx_scale"].numel()
    assert result.error.rel_rms == 0.0 and result.error.max_abs == 0.0


def constructed_lossless(seed: int) -> tuple[Nvfp4Weight, torch.Tensor]:
    """Blocks whose two 16-halves have power-of-two scales one octave apart, the lower half using
    only codes that stay on the grid one octave up ({0, 1, 2, 3, 4, 6}): exact in MXFP4 (docs/nvfp4.md)."""
    gen = torch.Generator().manual_seed(seed)
    n, k = 16, 256
    coarse = torch.tensor([0, 2, 4, 5, 6, 7, 8, 10, 12, 13, 14, 15], dtype=torch.uint8)  # |q| != 0.5, 1.5
    any_code = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    codes = torch.where(
        torch.arange(k) % 32 < 16, coarse[torch.randint(0, 12, (n, k), generator=gen)], any_code
    )
    octave = torch.randint(-6, 6, (n, k // 32), generator=gen).repeat_interleave(2, dim=1)
    octave[:, 0::2] -= 1  # the lower half's scale is one octave below the upper's
    scales = torch.exp2(octave.float()).to(torch.float8_e4m3fn)
    w = Nvfp4Weight(pack_fp4(codes), scales, torch.tensor(2.0**-3))
    return w, dequantize_nvfp4(w)


@pytest.mark.parametrize("rule", REQUANT_RULES)
def test_power_of_two_halves_requantize_exactly(rule: str) -> None:
    w, values = constructed_lossless(seed=4)
    result = requantize_nvfp4(w, rule)
    assert result.error.exact_blocks == result.error.total_blocks
    assert torch.equal(dequantize_mx(result.data, result.scale), values)


def test_requantized_layout_is_quantize_mx_layout() -> None:
    w = random_weight(8, 96, seed=5)  # K = 96: three MX blocks, six NVFP4 groups
    for rule in RULES:
        result = requantize_nvfp4(w, rule)
        data, scale = quantize_mx(dequantize_nvfp4(w), scale_rule=rule)
        assert result.data.shape == (8, 48) and result.scale.shape == (8, 3)
        assert torch.equal(result.data, data) and torch.equal(result.scale, scale)


def test_partial_last_mx_block_is_handled_as_zero_padded() -> None:
    w = random_weight(4, 48, seed=6)  # K = 48: one full and one half MX block
    for rule in REQUANT_RULES:
        result = requantize_nvfp4(w, rule)
        assert result.scale.shape == (4, 2)
        assert result.error.total_blocks == 8
    mse = requantize_nvfp4(w, "mse")
    ref = dequantize_nvfp4(w)
    padded = torch.nn.functional.pad(ref, (0, 16))
    assert mse.scale.flatten().tolist() == [reference.mse_code(b) for b in rows_of_blocks(padded)]


def test_error_report_matches_a_direct_computation() -> None:
    w = random_weight(24, 256, seed=7)
    result = requantize_nvfp4(w, "even")
    ref = dequantize_nvfp4(w).double()
    diff = dequantize_mx(result.data, result.scale).double() - ref
    assert result.error.rel_rms == pytest.approx(math.sqrt(float((diff**2).sum() / (ref**2).sum())), rel=1e-9)
    assert result.error.max_abs == pytest.approx(float(diff.abs().max()), rel=1e-6)
    assert result.error.exact_blocks == int((diff.reshape(-1, 32) == 0).all(-1).sum())
    assert "rule=even" in str(result.error) and "exact_blocks=" in str(result.error)


def test_nan_scale_is_refused_naming_the_layer_and_row() -> None:
    w = random_weight(8, 64, seed=8)
    scales = w.scales.view(torch.uint8).clone()
    scales[5, 2] = 0x7F  # E4M3 NaN
    bad = Nvfp4Weight(
        w.codes, scales.view(torch.float8_e4m3fn), w.global_scale, name="blocks.3.ffn.net.0.proj"
    )
    with pytest.raises(ValueError, match=r"blocks\.3\.ffn\.net\.0\.proj.*NaN block scale in row 5.*corrupt"):
        requantize_nvfp4(bad, "mse")
    with pytest.raises(ValueError, match="rule must be one of"):
        requantize_nvfp4(w, "uos")


def awkward_weight(seed: int) -> Nvfp4Weight:
    """Every E4M3 byte but NaN (negative, zero and subnormal scales), all-zero halves and blocks,
    -0 codes, per-row global scales (one shared by several rows) and a divisor."""
    gen = torch.Generator().manual_seed(seed)
    n, k = 48, 80  # K = 80: a partial last MX block
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    codes[::5, :8] = 0x88  # -0 -0
    codes[3, :16] = 0
    scales = torch.randint(0, 0x7F, (n, k // 16), dtype=torch.uint8, generator=gen)
    scales |= torch.randint(0, 2, scales.shape, dtype=torch.uint8, generator=gen) << 7
    g = torch.tensor([37.0, 0.0123, 2.0**-20] * (n // 3), dtype=torch.float32)
    return Nvfp4Weight(codes, scales.view(torch.float8_e4m3fn), g, global_divides=True)


@pytest.mark.parametrize("rule", RULES)
def test_requant_equals_quantize_mx_of_the_exact_dequant_on_awkward_weights(rule: str) -> None:
    w = awkward_weight(seed=10)
    result = requantize_nvfp4(w, rule)
    data, scale = quantize_mx(dequantize_nvfp4(w), scale_rule=rule)
    assert torch.equal(result.scale, scale)
    assert torch.equal(result.data, data)


def test_mse_equals_the_reference_on_awkward_weights() -> None:
    """``mse`` compares e0 with only one neighbour (module docstring); on every E4M3 byte, tiny
    (code 0) and zero blocks, -0 codes and per-row global scales it still picks what comparing all
    three exactly (the scalar reference, ``math.fsum``) picks, and the same elements."""
    w = awkward_weight(seed=12)
    result = requantize_nvfp4(w, "mse")
    padded = torch.nn.functional.pad(dequantize_nvfp4(w), (0, 16))
    codes, elems = [], []
    for block in rows_of_blocks(padded):
        codes.append(reference.mse_code(block))
        elems.extend(reference.mx_codes(block, codes[-1]))
    assert result.scale.flatten().tolist() == codes
    want = pack_fp4(torch.tensor(elems, dtype=torch.uint8).reshape(48, 96)[:, :80])
    assert torch.equal(result.data, want)
    assert 0 in codes and len(set(codes)) > 20


def test_mse_picks_each_neighbour_where_it_wins() -> None:
    """Constructed blocks (global scale 1): all 7.5 (floor saturates at 6; one octave up rounds to 8)
    wins with e0 + 1; a maximum of 4.125 with 31 elements on the finer grid of one octave down
    (0.25, 0.6875) wins with e0 - 1, the case the module docstring bounds at maximum < 4.47."""
    e2m1 = {0.5: 1, 1.0: 2, 6.0: 7}
    up = [e2m1[6.0]] * 32, [1.25, 1.25]  # 6 x 1.25 = 7.5 everywhere
    down = [e2m1[0.5]] * 16 + [e2m1[6.0]] + [e2m1[1.0]] * 15, [0.5, 0.6875]  # 0.25; 4.125, 0.6875
    codes = pack_fp4(torch.tensor([up[0], down[0]], dtype=torch.uint8))
    scales = torch.tensor([up[1], down[1]]).to(torch.float8_e4m3fn)
    w = Nvfp4Weight(codes, scales, torch.tensor(1.0))
    result = requantize_nvfp4(w, "mse")
    blocks = rows_of_blocks(dequantize_nvfp4(w))
    floor = [reference.floor_code(max(map(abs, b))) for b in blocks]
    assert [reference.mse_code(b) for b in blocks] == [floor[0] + 1, floor[1] - 1]
    assert result.scale.flatten().tolist() == [floor[0] + 1, floor[1] - 1]
    elems = [
        c for b, code in zip(blocks, result.scale.flatten().tolist()) for c in reference.mx_codes(b, code)
    ]
    assert torch.equal(result.data, pack_fp4(torch.tensor(elems, dtype=torch.uint8).reshape(2, 32)))


def test_mse_scores_the_lower_neighbour_wherever_its_gain_bound_allows_a_win() -> None:
    """``e0 - 1`` is scored only where the block's gain bound (the tables' per-element steps of
    1/GAIN_UNIT, rounded up) exceeds the least it loses at the maximum (module docstring). Blocks
    built at that edge (a maximum of 4.125 or 4.3125 next to many elements on ``e0 - 1``'s finer
    grid, 0.25 and 0.75 of the block scale, where the gain is largest) win with ``e0 - 1``, lose
    with it, or tie, and every one equals comparing all three exactly (the scalar reference)."""
    gen = torch.Generator().manual_seed(5)
    n = 1200
    fine = torch.tensor([1, 3, 9, 11, 1, 3, 0, 2], dtype=torch.uint8)  # +-0.5, +-1.5 (x 0.5: 0.25, 0.75)
    near = torch.tensor([0, 1, 2, 2, 2, 10, 9], dtype=torch.uint8)  # 0, +-0.5, +-1 next to the 6.0
    low = fine[torch.randint(0, len(fine), (n, 16), generator=gen)]
    high = near[torch.randint(0, len(near), (n, 16), generator=gen)]
    high[:, 0] = 7
    scale_low = torch.tensor([0.5, 0.5, 0.5, 0.46875, 0.53125])[torch.randint(0, 5, (n,), generator=gen)]
    scale_high = torch.tensor([0.6875, 0.6875, 0.71875])[torch.randint(0, 3, (n,), generator=gen)]
    scales = torch.stack((scale_low, scale_high), 1).to(torch.float8_e4m3fn)
    w = Nvfp4Weight(pack_fp4(torch.cat((low, high), 1)), scales, torch.tensor(1.0))
    blocks = rows_of_blocks(dequantize_nvfp4(w))
    want = [reference.mse_code(b) for b in blocks]
    result = requantize_nvfp4(w, "mse")
    assert result.scale.flatten().tolist() == want
    lower = [c == reference.floor_code(max(map(abs, b))) - 1 for b, c in zip(blocks, want)]
    assert 20 < sum(lower) < n - 20  # both outcomes, near the bound
    elems = [c for b, code in zip(blocks, want) for c in reference.mx_codes(b, code)]
    assert torch.equal(result.data, pack_fp4(torch.tensor(elems, dtype=torch.uint8).reshape(n, 32)))


def test_gain_bounds_hold_for_every_scale_byte_slot_and_code() -> None:
    """The per-element gain bound of the ``mse`` tables, in steps of 1/GAIN_UNIT of the block scale
    squared, is at least what the element's squared error drops from a slot's exponent to the one
    below and less than one step above it, recomputed in Python floats for every E4M3 byte, every
    slot and code, under three global scales."""
    from vllm_omni_mxfp4.kernels import requant

    used = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    for g in (1.0, 0.0123, 37.0):
        scales = used.view(torch.float8_e4m3fn)
        values = dequantize_nvfp4(
            Nvfp4Weight(
                pack_fp4(torch.arange(16, dtype=torch.uint8).expand(len(used), 16)),
                scales.view(-1, 1),
                torch.tensor(g),
            )
        )
        natural = requant.shared_exponent_codes(values[:, 7].abs(), "floor")
        _, err = requant._element_tables(values, natural)
        units = requant._gain_units(err, natural)
        for i, byte in enumerate(used.tolist()):
            for slot in range(1, len(requant.SHIFTS)):
                code = int(natural[i]) + requant.SHIFTS[slot]
                if not 1 <= code <= 254:
                    continue
                for c in range(16):
                    x = reference.nvfp4_element(c, byte, g, "exact")
                    drops = [reference.block_sse([x], k) for k in (code, code - 1)]
                    bound = (drops[0] - drops[1]) / 4.0 ** (code - 127) * requant.GAIN_UNIT
                    got = int(units[i, slot, c])
                    assert got >= bound and got < max(bound, 0.0) + 1 + 1e-6, (g, byte, slot, c, got, bound)


def test_workers_give_the_one_thread_result_and_change_no_thread_setting(monkeypatch) -> None:
    """``workers`` spreads the row chunks over threads; the bytes and the report do not depend on it,
    and the kernel never changes torch's thread count (inside the engine that is the engine's
    business; the convert command line sets it)."""
    from vllm_omni_mxfp4.formats import nvfp4
    from vllm_omni_mxfp4.kernels import requant

    monkeypatch.setattr(requant, "CHUNK_ELEMENTS", 1 << 16)
    w = random_weight(384, 2048, seed=13)
    assert len(list(nvfp4.row_slices(384, 2048, requant.CHUNK_ELEMENTS))) > 2

    def refuse(*_):
        raise AssertionError("the requantization kernel changed torch's thread count")

    monkeypatch.setattr(torch, "set_num_threads", refuse)
    single = requantize_nvfp4(w, "mse")
    spread = requantize_nvfp4(w, "mse", workers=3)
    assert torch.equal(single.data, spread.data) and torch.equal(single.scale, spread.scale)
    assert single.error.exact_blocks == spread.error.exact_blocks
    assert single.error.rel_rms == pytest.approx(spread.error.rel_rms, rel=1e-12)
    assert single.error.max_abs == spread.error.max_abs


def _cubed(n: int, k: int, seed: int) -> Nvfp4Weight:
    from vllm_omni_mxfp4.formats.nvfp4 import quantize_nvfp4

    gen = torch.Generator().manual_seed(seed)
    return quantize_nvfp4(torch.randn(n, k, generator=gen).pow(3).bfloat16(), "cubed")


@pytest.mark.parametrize("rule", REQUANT_RULES)
@pytest.mark.parametrize(
    "make",
    [
        lambda: random_weight(64, 512, seed=21),
        lambda: awkward_weight(seed=22),
        lambda: _cubed(96, 528, seed=23),
        lambda: constructed_lossless(24)[0],
    ],
    ids=["random-codes", "awkward", "cubed-gaussian-partial-block", "lossless"],
)
def test_the_kernel_computes_the_definition(rule: str, make) -> None:
    """The table kernel (what serving and convert run) gives the bytes and the report of the readable
    definition in ``formats/requant.py``, for every rule, on random codes over 14 octaves of scales,
    every E4M3 byte with per-row global divisors, a cubed Gaussian with a partial last block, and
    blocks that round-trip exactly."""
    from vllm_omni_mxfp4.formats import requant as definition

    w = make()
    fast, defined = requantize_nvfp4(w, rule), definition.requantize_nvfp4(w, rule)
    assert torch.equal(fast.scale, defined.scale)
    assert torch.equal(fast.data, defined.data)
    assert (fast.error.exact_blocks, fast.error.total_blocks) == (
        defined.error.exact_blocks,
        defined.error.total_blocks,
    )
    assert fast.error.max_abs == defined.error.max_abs
    assert fast.error.rel_rms == pytest.approx(defined.error.rel_rms, rel=1e-9, abs=1e-12)


def test_floor_code_zero_blocks_are_zeroed_like_quantize_mx() -> None:
    """A block below 2^-125 gets FLOOR code 0, which zeroes it (keeping signs), as quantize_mx does."""
    codes = torch.full((1, 16), 0x91, dtype=torch.uint8)  # 0.5 and -0.5: amax 2^-127, s * g = 2^-126
    w = Nvfp4Weight(codes, torch.full((1, 2), 2.0**-9).to(torch.float8_e4m3fn), torch.tensor(2.0**-117))
    result = requantize_nvfp4(w, "floor")
    assert int(result.scale) == 0
    assert torch.equal(result.data, quantize_mx(dequantize_nvfp4(w), scale_rule="floor")[0])
    assert result.error.exact_blocks == 0


@pytest.mark.parametrize("g", [2.0**-130, 2.0**121])
def test_scales_near_the_float32_limits_are_refused(g: float) -> None:
    scales = torch.full((1, 2), 1.0).to(torch.float8_e4m3fn)
    w = Nvfp4Weight(torch.zeros(1, 16, dtype=torch.uint8), scales, torch.tensor(g), name="blocks.0.odd")
    with pytest.raises(ValueError, match=r"blocks\.0\.odd.*float32 limits.*keep this layer unquantized"):
        requantize_nvfp4(w, "mse")


def test_mse_ties_keep_the_floor_exponent() -> None:
    """Blocks of codes {0, 1, 2, 3, 4, 6} x 2^k are exact at the floor exponent and one above: the
    tie keeps floor's bytes (as the lossless round trip needs); all-zero blocks keep code 0."""
    gen = torch.Generator().manual_seed(11)
    coarse = torch.tensor([0, 2, 4, 5, 6, 7, 8, 10, 12, 13, 14, 15], dtype=torch.uint8)
    codes = coarse[torch.randint(0, 12, (8, 64), generator=gen)]
    codes[:, 5] = 7  # a 6.0 in every block: the floor exponent is the scales' own
    codes[:, 37] = 7
    codes[7] = 0
    scales = torch.exp2(torch.randint(-4, 4, (8, 2), generator=gen).float()).repeat_interleave(2, dim=1)
    w = Nvfp4Weight(pack_fp4(codes), scales.to(torch.float8_e4m3fn), torch.tensor(0.25))
    mse, floor = requantize_nvfp4(w, "mse"), requantize_nvfp4(w, "floor")
    assert mse.error.exact_blocks == mse.error.total_blocks
    assert torch.equal(mse.scale, floor.scale) and torch.equal(mse.data, floor.data)
    assert mse.scale[7].tolist() == [0, 0]


def test_quantize_nvfp4_follows_modelopts_recipe_against_a_scalar_reference() -> None:
    """The source side of the quality comparison: ModelOpt's recipe (g = amax / (6 * 448) in
    float32, each block scale amax_b / (6 g) rounded to the nearest E4M3, codes RNE E2M1 of
    x / (s g)), recomputed element by element in Python floats."""
    from vllm_omni_mxfp4.formats.nvfp4 import quantize_nvfp4

    weight = (torch.randn(6, 48, generator=torch.Generator().manual_seed(11)) * 0.02).bfloat16()
    ours = quantize_nvfp4(weight)
    x = weight.float().tolist()
    g = reference.f32(max(abs(v) for row in x for v in row) / reference.f32(6 * 448))
    assert float(ours.global_scale) == g
    e4m3 = sorted((reference.e4m3_value(b), b) for b in range(0x7F))
    codes = unpack_fp4(ours.codes).tolist()
    for r, row in enumerate(x):
        for j in range(3):
            block = row[16 * j : 16 * (j + 1)]
            want = reference.f32(max(abs(v) for v in block) / reference.f32(6 * g))
            value, byte = min(e4m3, key=lambda vb: (abs(vb[0] - want), vb[1] & 1))
            assert int(ours.scales.view(torch.uint8)[r, j]) == byte, (r, j)
            sg = reference.f32(value * g)
            for i, v in enumerate(block):
                expected = reference.e2m1_round(reference.f32(v / sg))
                assert reference.e2m1_value(codes[r][16 * j + i]) == expected, (r, j, i)


def test_fake_quantize_nvfp4_is_the_dequant_of_the_quantization() -> None:
    from vllm_omni_mxfp4.formats.nvfp4 import fake_quantize_nvfp4, quantize_nvfp4

    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(12))
    expected = dequantize_nvfp4(quantize_nvfp4(x.reshape(15, 64)), order="scale_first").reshape(3, 5, 64)
    assert torch.equal(fake_quantize_nvfp4(x), expected)
    assert torch.equal(fake_quantize_nvfp4(torch.zeros(2, 32)), torch.zeros(2, 32))
