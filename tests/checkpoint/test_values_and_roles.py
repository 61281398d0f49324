"""Fail closed on inputs whose bytes are valid but whose meaning is not: Smooth factors no calibration
produces, float tensors in a dtype msModelSlim does not write for their role, labels msModelSlim never
gives, and an original whose ``config.json`` builds other blocks than its weights hold.

Each case edits a copy of the real msModelSlim export (``expert_copy``, see test_faults.py) or of its
original, and the merge refuses it naming the tensor or file, what was expected and what was found.
"""

from __future__ import annotations

import json

import pytest
import torch

from .edits import assert_refused, relabel, replace

OPROJ = "blocks.1.self_attn.o"  # quantized, no Smooth
SMOOTHED = "blocks.2.ffn.2"  # quantized with its own Smooth (not a fused piece)


def _at(index: int, value: float):
    def edit(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[index] = value
        return t

    return edit


@pytest.mark.parametrize("value", [1e30, 1e38, 1e-30])
def test_a_smooth_factor_outside_the_calibrated_range_is_refused(expert_copy, tmp_path, value):
    """1e30 and 1e38 are finite in float32 and in BF16 (the export's dtype): they would load, and
    every output would be non-finite."""
    name = f"{SMOOTHED}.div.mul_scale"
    message = (
        rf"mul_scale '{name}' holds [-+0-9.e]+ at \[5\]; expected finite values in \[2\^-24, 2\^24\] "
        r"\(5\.96e-08 to 1\.68e\+07\), the range of calibrated Smooth factors"
    )
    assert_refused(expert_copy, tmp_path, message, replace(name, _at(5, value)))


def test_a_smooth_factor_at_the_ends_of_the_range_is_valid(expert_copy, tmp_path):
    from .edits import edit, merge_t2v

    original, quant = expert_copy
    name = f"{SMOOTHED}.div.mul_scale"
    edit(quant / "high_noise_model", replace(name, _at(5, 2.0**24)))
    edit(quant / "high_noise_model", replace(name, _at(6, 2.0**-24)))
    merge_t2v(original, quant, tmp_path / "out")


def test_a_mul_scale_relabelled_to_another_float_dtype_is_refused(expert_copy, tmp_path):
    """The same bytes under an F16 header are other numbers: refused by dtype, not by value."""
    name = f"{SMOOTHED}.div.mul_scale"
    message = (
        rf"mul_scale '{name}' has dtype F16; expected BF16, the dtype msModelSlim writes for a Linear's "
        r"mul_scale: its original weight's dtype"
    )
    assert_refused(expert_copy, tmp_path, message, replace(name, lambda t: t.view(torch.float16)))


def test_a_quantized_linears_bias_in_another_dtype_is_refused(expert_copy, tmp_path):
    name = f"{OPROJ}.bias"
    message = rf"bias '{name}' has dtype BF16; expected F32, the dtype msModelSlim writes for the bias of a quantized Linear"
    assert_refused(expert_copy, tmp_path, message, replace(name, lambda t: t.to(torch.bfloat16)))


def test_a_dual_scale_relabelled_to_another_float_dtype_is_refused(expert_copy, tmp_path):
    name = f"{OPROJ}.weight_dual_scale"
    message = rf"weight_dual_scale '{name}' has dtype BF16; expected F32, the dtype msModelSlim writes"
    assert_refused(expert_copy, tmp_path, message, replace(name, lambda t: t.to(torch.bfloat16)))


@pytest.mark.parametrize("label", ["W4A4_MXFP4", "W4A4_MXFP4_DUALSCALE"])
def test_a_bias_labelled_as_quantized_is_named(expert_copy, tmp_path, label):
    """Labelled with the other MXFP4 format it used to read as a mix of formats; with the export's own
    format it was accepted. msModelSlim labels every bias FLOAT."""
    name = f"{OPROJ}.bias"
    message = rf"tensor '{name}' is labelled {label}; msModelSlim labels every bias FLOAT"
    assert_refused(expert_copy, tmp_path, message, relabel(name, label))


def test_a_smooth_vector_labelled_as_quantized_is_named(expert_copy, tmp_path):
    name = f"{SMOOTHED}.div.mul_scale"
    message = rf"tensor '{name}' is labelled W4A4_MXFP4; msModelSlim labels every mul_scale FLOAT"
    assert_refused(expert_copy, tmp_path, message, relabel(name, "W4A4_MXFP4"))


def test_two_mxfp4_formats_are_named_by_a_tensor_of_each(expert_copy, tmp_path):
    def mutate(tensors, entries):
        entries[f"{OPROJ}.weight"] = entries[f"{OPROJ}.weight_scale"] = "W4A4_MXFP4"

    message = rf"mixes W4A4_MXFP4 \(e\.g\. '{OPROJ}\.weight'\) and W4A4_MXFP4_DUALSCALE \(e\.g\. 'blocks\.1\.self_attn\."
    assert_refused(expert_copy, tmp_path, message, mutate)


@pytest.mark.parametrize("num_layers", [2, 4])
def test_an_original_whose_config_builds_other_blocks_is_refused(expert_copy, tmp_path, num_layers):
    """The tiny original holds blocks 0-2; a config.json saying 2 would drop block 2 at load (vLLM-Omni
    skips its tensors with a warning), one saying 4 would leave block 3 unloaded."""
    original, _ = expert_copy
    path = original / "transformer" / "config.json"
    config = json.loads(path.read_text())
    config["num_layers"] = num_layers
    path.write_text(json.dumps(config))
    message = (
        rf"transformer/config\.json: disagrees with the original's weights: vLLM-Omni's WanTransformer3DModel "
        rf"built from it has {num_layers} blocks \(num_layers={num_layers}\), but the weights hold blocks 0-2 \(3\)"
    )
    assert_refused(expert_copy, tmp_path, message)
