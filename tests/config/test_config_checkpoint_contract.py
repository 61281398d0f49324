"""The checkpoint's ``quantization_config``: what ``to_checkpoint_dict`` writes, and key roles.

The merge (``vllm_omni_mxfp4.checkpoint``) writes each transformer's block; the user guide
documents it. ``to_checkpoint_dict`` of a config built the way the merge builds it must give
exactly that block, and a key's role alone must decide whether it is written and how a rebuild
from a checkpoint treats it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_omni_mxfp4.config import Mxfp4Config, Mxfp4DualScaleConfig, reconcile_with_checkpoint
from vllm_omni_mxfp4.config.keys import REQUIREMENT, check_bool, key

USER_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "user_guide.md"
CONFIG_BLOCK = re.compile(r"<!-- doc-test: config -->\n```json\n(.*?)```", re.DOTALL)


def block_order(names: list[str]) -> list[str]:
    """The merge's order of layer names: numbers compare as numbers (blocks.2 before blocks.10)."""
    return sorted(names, key=lambda name: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)])


def _documented_checkpoint_blocks() -> list[dict]:
    blocks = [json.loads(text) for text in CONFIG_BLOCK.findall(USER_GUIDE.read_text(encoding="utf-8"))]
    return [b["quantization_config"] for b in blocks if isinstance(b, dict) and "quantization_config" in b]


def _as_the_merge_builds_it(block: dict):
    """The config the merge describes: the serialized flag, its BF16 layers, Smooth (mxfp4 only)."""
    if block["quant_method"] == "mxfp4":
        return Mxfp4Config(
            is_checkpoint_mxfp4_serialized=True,
            ignored_layers=block["ignored_layers"],
            require_smooth_scale=block["require_smooth_scale"],
        )
    return Mxfp4DualScaleConfig(is_checkpoint_serialized=True, ignored_layers=block["ignored_layers"])


def test_the_guide_documents_a_block_per_method():
    assert sorted(b["quant_method"] for b in _documented_checkpoint_blocks()) == ["mxfp4", "mxfp4_dualscale"]


@pytest.mark.parametrize("block", _documented_checkpoint_blocks(), ids=lambda b: b["quant_method"])
def test_checkpoint_dict_is_the_documented_block(block):
    config = _as_the_merge_builds_it(block)
    written = config.to_checkpoint_dict()
    # The merge lists BF16 layers in block order (blocks.2 before blocks.10).
    assert written == {**block, "ignored_layers": block_order(block["ignored_layers"])}
    # ... and writes the keys in this order.
    expected_order = ["quant_method", config.serialized_key(), "ignored_layers"]
    if block["quant_method"] == "mxfp4":
        expected_order.append("require_smooth_scale")
    assert list(written) == expected_order
    assert type(config).from_dict(json.loads(json.dumps(written))) == config


def test_layer_lists_are_in_the_merges_block_order():
    names = [
        "blocks.10.ffn.net_2",
        "proj_out",
        "blocks.2.attn1.to_qkv",
        "blocks.2.attn1.to_out",
        "blocks.1.ffn.net_2",
    ]
    expected = [
        "blocks.1.ffn.net_2",
        "blocks.2.attn1.to_out",
        "blocks.2.attn1.to_qkv",
        "blocks.10.ffn.net_2",
        "proj_out",
    ]
    assert block_order(names) == expected
    for config in (
        Mxfp4DualScaleConfig(is_checkpoint_serialized=True, ignored_layers=names),
        Mxfp4Config(is_checkpoint_mxfp4_serialized=True, ignored_layers=list(reversed(names))),
    ):
        assert config.to_checkpoint_dict()["ignored_layers"] == expected


def test_runtime_keys_stay_out_of_the_checkpoint_dict():
    single = Mxfp4Config(
        w4a8_fallback_steps=[1], w4a8_fallback_layers=["proj_out"], mxfp4_scale_alg=2, backend="npu"
    )
    assert single.to_checkpoint_dict() == Mxfp4Config().to_checkpoint_dict()
    dual = Mxfp4DualScaleConfig(num_bf16_fallback_layers=0, backend="emulated")
    assert dual.to_checkpoint_dict() == Mxfp4DualScaleConfig().to_checkpoint_dict()


@dataclass(frozen=True)
class _WithAnotherRequirement(Mxfp4Config):
    """A config with one more key, declared on one line as a new key would be."""

    require_strict_scales: bool = key(False, check_bool, role=REQUIREMENT)


def test_a_new_key_is_one_line_and_its_role_decides_everything():
    cls = _WithAnotherRequirement
    assert "require_strict_scales" in cls.valid_keys()
    assert cls.from_dict({"require_strict_scales": True}).require_strict_scales is True
    with pytest.raises(ValueError, match="require_strict_scales must be a boolean"):
        cls.from_dict({"require_strict_scales": "yes"})
    assert cls(require_strict_scales=True).to_checkpoint_dict()["require_strict_scales"] is True
    # A requirement holds if either side sets it, and a change makes vLLM-Omni rebuild the config.
    runtime = cls(is_checkpoint_mxfp4_serialized=True, backend="emulated")
    checkpoint = {
        "quant_method": "mxfp4",
        "is_checkpoint_mxfp4_serialized": True,
        "require_strict_scales": True,
    }
    rebuilt = reconcile_with_checkpoint(runtime, checkpoint)
    assert rebuilt.require_strict_scales is True and rebuilt.backend == "auto"
    unchanged = reconcile_with_checkpoint(
        cls(is_checkpoint_mxfp4_serialized=True, backend="emulated"),
        {"quant_method": "mxfp4", "is_checkpoint_mxfp4_serialized": True},
    )
    assert unchanged.backend == "emulated"
