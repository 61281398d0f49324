"""``svd_lowrank_layers``: the stored low-rank pairs of a pre-quantized checkpoint (msModelSlim
``svd_res``, merged), per runtime Linear with its rank."""

from __future__ import annotations

import pytest

from vllm_omni_mxfp4.config import Mxfp4Config, Mxfp4DualScaleConfig

OFFLINE = {
    Mxfp4Config: {"is_checkpoint_mxfp4_serialized": True},
    Mxfp4DualScaleConfig: {"is_checkpoint_serialized": True},
}
RANKS = {"blocks.1.ffn.net_2": 16, "blocks.0.attn1.to_qkv": 8}


@pytest.mark.parametrize("cls", list(OFFLINE))
def test_ranks_are_kept_in_block_order_and_written_to_the_checkpoint(cls):
    config = cls.from_dict({**OFFLINE[cls], "svd_lowrank_layers": RANKS})
    assert list(config.svd_lowrank_layers.items()) == [
        ("blocks.0.attn1.to_qkv", 8),
        ("blocks.1.ffn.net_2", 16),
    ]
    assert config.to_checkpoint_dict()["svd_lowrank_layers"] == config.svd_lowrank_layers
    assert cls.from_dict(config.to_dict()) == config
    assert "svd_lowrank_layers" not in cls.from_dict(OFFLINE[cls]).to_dict()  # omitted when empty


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"svd_lowrank_layers": [16]}, r"svd_lowrank_layers must be an object mapping .* Got \[16\]"),
        ({"svd_lowrank_layers": {"blocks.1.ffn.net_2": 0}}, r"Entry 'blocks\.1\.ffn\.net_2' has rank 0"),
        ({"svd_lowrank_layers": {"blocks.1.ffn.net_2": 1.5}}, r"has rank 1\.5"),
        (
            {"svd_lowrank_layers": {"": 4}},
            r"svd_lowrank_layers must be an object mapping exact runtime Linear paths",
        ),
        (
            {"svd_lowrank_layers": RANKS, "ignored_layers": ["blocks.1.ffn.net_2"]},
            r"\['blocks\.1\.ffn\.net_2'\] are listed in svd_lowrank_layers and in ignored_layers, which keeps them "
            r"in BF16",
        ),
        (
            {"svd_lowrank_layers": RANKS, "mxfp8_layers": ["blocks.0.attn1.to_qkv"]},
            r"\['blocks\.0\.attn1\.to_qkv'\] are listed in svd_lowrank_layers and in mxfp8_layers",
        ),
    ],
)
def test_bad_values_are_refused_by_name(extra, message):
    with pytest.raises(ValueError, match=message):
        Mxfp4Config.from_dict({**OFFLINE[Mxfp4Config], **extra})


@pytest.mark.parametrize("cls", list(OFFLINE))
def test_an_online_config_is_refused(cls):
    with pytest.raises(
        ValueError, match=r"but this mxfp4(_dualscale)? config is online .* use svd_rank instead"
    ):
        cls.from_dict({"svd_lowrank_layers": RANKS})
