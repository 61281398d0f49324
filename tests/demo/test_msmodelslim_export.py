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


# ----------------------------------------------------------------------------- calibration

CALIBRATION = {
    "height": 32,
    "width": 32,
    "num_frames": 5,
    "steps": 3,
    "guidance_scale": 2.0,
    "guidance_scale_2": 1.5,
}
PROMPTS = (
    "a red square moving left slowly on a black background",
    "a green bar moving up quickly on a gray background",
)


@pytest.fixture(scope="module")
def calibrated():
    """Maxima of the shipped trained model over each prompt alone and over both (seed 0: a training seed)."""
    import torch

    from vllm_omni_mxfp4_tiny.calibration import activation_maxima
    from vllm_omni_mxfp4_tiny.trained_wan import SHIPPED

    torch.manual_seed(0)
    runs = {p: activation_maxima(SHIPPED, [p], [0], **CALIBRATION) for p in PROMPTS}
    return runs, activation_maxima(SHIPPED, list(PROMPTS), [0], **CALIBRATION)


def test_calibration_records_every_smoothed_linear_of_both_experts(calibrated):
    import torch

    _, both = calibrated
    specs = exporter.default_specs(6, ("transformer", "transformer_2"))
    for folder, spec in specs.items():
        for group in spec.smooth:
            for name in group:
                amax = both[folder][name]
                assert amax.dim() == 1 and bool(torch.isfinite(amax).all()) and float(amax.min()) >= 0, name
            # Linears of one Smooth group read one input, so one set of maxima.
            assert all(torch.equal(both[folder][name], both[folder][group[0]]) for name in group), group
    high, low = both["transformer"]["blocks.1.ffn.0"], both["transformer_2"]["blocks.1.ffn.0"]
    assert not torch.equal(high, low)  # each expert calibrated on its own steps


def test_calibration_keeps_the_maximum_over_the_whole_set(calibrated):
    """Over two prompts, each channel's maximum is the larger of the two prompts' own."""
    import torch

    alone, both = calibrated
    for folder in both:
        for name, amax in both[folder].items():
            expected = torch.maximum(*(alone[p][folder][name] for p in PROMPTS))
            torch.testing.assert_close(amax, expected, rtol=1e-4, atol=1e-5)


def test_an_expert_with_no_step_is_refused():
    from vllm_omni_mxfp4_tiny.calibration import activation_maxima
    from vllm_omni_mxfp4_tiny.trained_wan import SHIPPED

    with pytest.raises(ValueError, match=r"\['transformer_2'\] of .* ran no denoising step with 1 steps"):
        activation_maxima(SHIPPED, [PROMPTS[0]], [0], **{**CALIBRATION, "steps": 1})


def test_bad_calibration_maxima_name_the_group(calibrated):
    import torch

    _, both = calibrated
    group = ["blocks.1.self_attn.q", "blocks.1.self_attn.k", "blocks.1.self_attn.v"]
    good = dict(both["transformer"])
    assert exporter._calibrated(good, group, 256).shape == (256,)
    missing = {k: v for k, v in good.items() if k != "blocks.1.self_attn.k"}
    with pytest.raises(ValueError, match=r"no entry for \['blocks.1.self_attn.k'\]"):
        exporter._calibrated(missing, group, 256)
    short = {**good, "blocks.1.self_attn.q": good["blocks.1.self_attn.q"][:128]}
    with pytest.raises(ValueError, match=r"shape \(128,\); expected 256 finite values"):
        exporter._calibrated(short, group, 256)
    nan = good["blocks.1.self_attn.q"].clone()
    nan[3] = float("nan")
    with pytest.raises(ValueError, match="expected 256 finite values"):
        exporter._calibrated({**good, "blocks.1.self_attn.q": nan}, group, 256)
    assert torch.equal(good["blocks.1.self_attn.q"], both["transformer"]["blocks.1.self_attn.q"])


def test_export_refuses_maxima_without_every_expert(calibrated, tmp_path):
    from vllm_omni_mxfp4_tiny.trained_wan import SHIPPED

    _, both = calibrated
    with pytest.raises(ValueError, match=r"no calibration for \['transformer_2'\]"):
        exporter.export_pipeline(SHIPPED, tmp_path / "out", maxima={"transformer": both["transformer"]})
