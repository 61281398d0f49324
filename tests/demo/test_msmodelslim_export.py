"""The demo's msModelSlim exporter: names, recipe, refusals (the export itself runs in test_demo_e2e and
tests/checkpoint, which merge and load what it writes)."""

from __future__ import annotations

import gc
import json
import weakref

import pytest

from vllm_omni_mxfp4_tiny import msmodelslim_export as exporter


@pytest.mark.parametrize(
    ("diffusers", "original"),
    [
        ("blocks.3.attn1.to_q.weight", "blocks.3.self_attn.q.weight"),
        ("blocks.3.attn2.to_out.0.bias", "blocks.3.cross_attn.o.bias"),
        ("blocks.0.attn1.norm_k.weight", "blocks.0.self_attn.norm_k.weight"),
        ("blocks.1.norm2.weight", "blocks.1.norm3.weight"),
        ("blocks.1.ffn.net.0.proj.weight", "blocks.1.ffn.0.weight"),
        ("blocks.1.ffn.net.2.weight", "blocks.1.ffn.2.weight"),
        ("blocks.7.scale_shift_table", "blocks.7.modulation"),
        ("scale_shift_table", "head.modulation"),
        ("proj_out.weight", "head.head.weight"),
        ("condition_embedder.time_proj.weight", "time_projection.1.weight"),
        ("condition_embedder.text_embedder.linear_2.bias", "text_embedding.2.bias"),
        ("patch_embedding.weight", "patch_embedding.weight"),
    ],
)
def test_original_names(diffusers, original):
    assert exporter.original_name(diffusers) == original


def test_missing_msmodelslim_is_a_clear_import_error(monkeypatch):
    real = exporter.importlib.util.find_spec
    monkeypatch.setattr(
        exporter.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "msmodelslim" else real(name, *a),
    )
    with pytest.raises(ImportError, match=r"msModelSlim is not installed.*pip install 'msmodelslim>=26.1'"):
        exporter.export_pipeline("/nonexistent", "/nonexistent-out")


def test_default_recipe_keeps_float_layers_and_smooths_every_quantized_linear():
    specs = exporter.default_specs(3, ("transformer", "transformer_2"))
    high, low = specs["transformer"], specs["transformer_2"]
    assert high.fmt == low.fmt == "dual"
    assert "*blocks.0.*" in high.exclude and "blocks.2.ffn.2" in low.exclude
    smoothed_high = {name for group in high.smooth for name in group}
    smoothed_low = {name for group in low.smooth for name in group}
    per_block = ["self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o"]
    per_block += ["cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2"]
    assert smoothed_high == {f"blocks.{b}.{n}" for b in (1, 2) for n in per_block}
    assert smoothed_low == {f"blocks.{b}.{n}" for b in (0, 1, 2) for n in per_block} - {"blocks.2.ffn.2"}
    assert list(exporter.default_specs(2, ("transformer",))) == ["transformer"]
    with pytest.raises(ValueError, match="at least 2 transformer blocks"):
        exporter.default_specs(1, ("transformer",))


def test_bad_inputs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="fmt must be 'dual' or 'single'"):
        exporter.ExpertSpec("w4a4", "mindie", exclude=[])
    with pytest.raises(NotImplementedError, match="image_dim=1280"):
        exporter.OriginalWan({"image_dim": 1280})
    with pytest.raises(ValueError, match="transformer config: missing key 'in_channels'"):
        exporter.OriginalWan({"num_attention_heads": 2, "attention_head_dim": 8, "patch_size": [1, 2, 2]})
    existing = tmp_path / "export"
    existing.mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        exporter.export_pipeline(tmp_path, existing)
    with pytest.raises(FileNotFoundError, match="model_index.json: missing"):
        exporter.export_pipeline(tmp_path, tmp_path / "new")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "vae": ["x", "y"]}))
    with pytest.raises(ValueError, match="lists no transformer"):
        exporter.export_pipeline(tmp_path, tmp_path / "new")


class _Node:
    """A tracked object that can be put in a reference cycle (garbage only a collection frees)."""

    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    first, second = _Node(), _Node()
    first.other, second.other = second, first
    return weakref.ref(first)


def test_collections_inside_the_block_skip_older_objects_only():
    """msModelSlim's per-processor gc.collect() inside the block frees what the block made and leaves
    older objects for the first collection after it (msmodelslim_export.collections_skip_older_objects)."""
    gc.disable()  # no automatic collection between the steps below: only the explicit ones
    try:
        older_cycle = _cycle()  # unreachable already, but a cycle: alive until a collection
        with exporter.collections_skip_older_objects():
            assert gc.get_freeze_count() > 0
            newer_cycle = _cycle()
            gc.collect()
            assert newer_cycle() is None
            assert older_cycle() is not None
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert older_cycle() is None
    finally:
        gc.enable()
