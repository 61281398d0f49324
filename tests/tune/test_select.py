"""``vllm_omni_mxfp4.tune.select``: units' bytes, budgets, the selection by gain, the priors, the configs."""

from __future__ import annotations

import math

import pytest

from vllm_omni_mxfp4.config import parse_quantization
from vllm_omni_mxfp4.tune.select import (
    Budget,
    Selection,
    Unit,
    edge_prior_order,
    first_blocks_order,
    random_order,
    select_by_gain,
    spearman,
)

LAYERS = ("attn1.to_qkv", "attn1.to_out.0", "ffn.net_0.proj", "ffn.net_2")


def wan_units(blocks: int = 3, components=("transformer", "transformer_2"), method="mxfp4") -> list[Unit]:
    """Units of a Wan-like model: 4 Linears per block, dim 256 (the QKV fused: N = 768; FFN 512)."""
    shapes = {
        "attn1.to_qkv": (768, 256),
        "attn1.to_out.0": (256, 256),
        "ffn.net_0.proj": (512, 256),
        "ffn.net_2": (256, 512),
    }
    return [
        Unit(c, f"blocks.{b}.{layer}", method, *shapes[layer], b, method == "mxfp4")
        for c in components
        for b in range(blocks)
        for layer in LAYERS
    ]


def test_bytes_follow_the_formats():
    unit = Unit("transformer", "blocks.0.ffn.net_2", "mxfp4", 256, 512, 0, True)
    assert unit.bf16_bytes == 256 * 512 * 2
    assert unit.packed_bytes == 256 * 256 + 256 * 16  # FP4 values + one E8M0 scale per 32
    dual = Unit("transformer", "blocks.0.ffn.net_2", "mxfp4_dualscale", 256, 512, 0, False)
    assert dual.packed_bytes == unit.packed_bytes + 4 * 256 * 1  # one FP32 scale per 512
    assert unit.extra_bytes == unit.bf16_bytes - unit.packed_bytes


def test_a_layer_budget_takes_the_largest_positive_gains():
    units = wan_units()
    gains = {u.key: float(i % 7) - 1.0 for i, u in enumerate(units)}  # some negative, some zero
    chosen = select_by_gain(units, gains, Budget(bf16_layers=3))
    best = sorted((g for g in gains.values() if g > 0), reverse=True)[:3]
    assert sorted((gains[u.key] for u in chosen), reverse=True) == best
    assert all(gains[u.key] > 0 for u in select_by_gain(units, gains, Budget(bf16_layers=len(units))))


def test_a_byte_budget_goes_by_gain_per_byte_and_stays_within_it():
    units = wan_units(blocks=1, components=("transformer",))
    qkv, out, up, down = units
    gains = {qkv.key: 3.0, out.key: 1.2, up.key: 0.1, down.key: 1.0}  # per byte: out > down > qkv
    total = sum(u.bf16_bytes for u in units)
    budget = Budget(bf16_fraction=(out.bf16_bytes + down.bf16_bytes) / total)
    chosen = select_by_gain(units, gains, budget)
    assert [u.key for u in chosen] == [out.key, down.key]
    assert sum(u.bf16_bytes for u in chosen) <= budget.bf16_byte_limit(units)
    # both limits hold together
    assert len(select_by_gain(units, gains, Budget(bf16_layers=1, bf16_fraction=1.0))) == 1


@pytest.mark.parametrize(
    "kwargs", [{"bf16_layers": -1}, {"bf16_fraction": 1.5}, {"bf16_fraction": -0.1}, {"w4a8_steps": -2}]
)
def test_a_bad_budget_is_refused_naming_the_flag(kwargs):
    with pytest.raises(ValueError, match="--max-"):
        Budget(**kwargs)


def test_priors_orders():
    units = wan_units(blocks=4)
    first = first_blocks_order(units)
    assert [u.block for u in first] == sorted(u.block for u in units)
    edge = edge_prior_order([*units, Unit("transformer", "proj_out", "mxfp4", 64, 256, None, True)])
    assert edge[0].layer == "proj_out"  # outside the blocks first
    assert [u.block for u in edge[1:]][::8] == [0, 3, 1, 2]  # then first, last, second, second-to-last
    assert random_order(units, 0) == random_order(units, 0) != random_order(units, 1)
    assert sorted(random_order(units, 3), key=units.index) == units


def test_configs_serve_as_written():
    units = wan_units(blocks=2)
    same = Selection(
        "s", ("transformer/blocks.0.ffn.net_2", "transformer_2/blocks.0.ffn.net_2"), a8_steps=(0, 3)
    )
    flat = same.config("mxfp4", ["transformer", "transformer_2"])
    assert flat == {
        "method": "mxfp4",
        "ignored_layers": ["blocks.0.ffn.net_2"],
        "w4a8_fallback_layers": [],
        "w4a8_fallback_steps": [0, 3],
    }
    differ = Selection(
        "d", ("transformer/blocks.1.attn1.to_qkv",), ("transformer_2/blocks.0.ffn.net_2",),
        kept={"transformer_2": ("blocks.1.ffn.net_2",)},
    )  # fmt: skip
    per = differ.config("mxfp4", ["transformer", "transformer_2"])
    assert per["transformer"]["ignored_layers"] == ["blocks.1.attn1.to_qkv"]
    assert per["transformer_2"]["ignored_layers"] == ["blocks.1.ffn.net_2"]  # the family default stays BF16
    assert per["transformer_2"]["w4a8_fallback_layers"] == ["blocks.0.ffn.net_2"]
    for config in (flat, per):
        parse_quantization(config)  # the config parser accepts both forms
    dual = Selection("x", ("transformer/blocks.0.ffn.net_2",)).config("mxfp4_dualscale", ["transformer"])
    assert dual == {
        "method": "mxfp4_dualscale",
        "num_bf16_fallback_layers": 0,  # tune chose instead of the leading-block default
        "ignored_layers": ["blocks.0.ffn.net_2"],
    }
    parse_quantization(dual)
    plan = differ.plan()
    assert plan["layers"] == {
        "transformer/blocks.1.attn1.to_qkv": "bf16",
        "transformer_2/blocks.0.ffn.net_2": "w4a8",
    }
    assert units  # the helper builds what the other tests use


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # hand-computed: ranks (1, 2, 3, 4, 5) and (2, 1, 4, 3, 5): d^2 sum 4 -> 1 - 6*4/(5*24) = 0.8
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    # ties get average ranks: (1.5, 1.5, 3) against (1, 2, 3)
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)
    with pytest.raises(ValueError):
        spearman([1], [1])
