"""Fail closed: every broken input is refused with a message naming the tensor or file, and no output.

Each case edits a copy of a real msModelSlim export (``expert_copy``): ``high_noise_model`` is the
unsharded MindIE-format dual-scale export of ``transformer`` (Smooth on blocks.1 Q/K/V, the
cross-attention K/V of blocks.1 and blocks.2 ffn.2; blocks.0 FLOAT), ``low_noise_model`` the sharded one.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_omni_mxfp4.checkpoint import CheckpointError
from vllm_omni_mxfp4.cli import main

from .edits import assert_refused, drop, edit, merge_t2v, relabel, replace

OPROJ = "blocks.1.self_attn.o"  # quantized, no Smooth: 512 x 512
QPROJ = "blocks.1.self_attn.q.linear"  # quantized with Smooth


def test_missing_description_file(expert_copy, tmp_path):
    original, quant = expert_copy
    (description,) = (quant / "high_noise_model").glob("quant_model_description*.json")
    description.unlink()
    assert_refused(expert_copy, tmp_path, r"high_noise_model: missing msModelSlim description file")


def test_missing_expert_directory(expert_copy, tmp_path):
    original, quant = expert_copy
    for path in (quant / "low_noise_model").iterdir():
        path.unlink()
    (quant / "low_noise_model").rmdir()
    assert_refused(expert_copy, tmp_path, r"quantized export directory .*low_noise_model does not exist")


@pytest.mark.parametrize("label", ["W8A8_DYNAMIC", "W4A4_MXFP4_FLATQUANT", "W4A8_MXFP", "BF16"])
def test_unknown_description_label(expert_copy, tmp_path, label):
    message = rf"tensor '{OPROJ}.weight_scale' has unsupported description label '{label}'"
    assert_refused(expert_copy, tmp_path, message, relabel(f"{OPROJ}.weight_scale", label))


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (
            (f"{OPROJ}.weight",),
            rf"layer blocks\.1\.attn1\.to_out\.0 \(export {OPROJ}\): quantized layer is missing its weight",
        ),
        (
            (f"{OPROJ}.weight_scale",),
            rf"\(export {OPROJ}\): quantized \(W4A4_MXFP4_DUALSCALE\) but {OPROJ}\.weight_scale is missing",
        ),
        ((f"{OPROJ}.weight_dual_scale",), rf"but {OPROJ}\.weight_dual_scale is missing"),
        ((f"{OPROJ}.bias",), rf"\(export {OPROJ}\): the original has a bias but the export has none"),
        (
            ("blocks.1.self_attn.q.div.mul_scale",),
            r"Smooth-wrapped tensors without blocks\.1\.self_attn\.q\.div\.mul_scale",
        ),
    ],
)
def test_missing_tensors_of_a_quantized_layer(expert_copy, tmp_path, names, message):
    assert_refused(expert_copy, tmp_path, message, drop(*names))


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (f"{OPROJ}.weight", lambda t: t[:, :-1], r"has shape \[512, 255\]; expected \[512, 256\] \(N, K/2\)"),
        (f"{OPROJ}.weight", lambda t: torch.cat([t, t]), r"has shape \[1024, 256\]; expected \[512, 256\]"),
        (
            f"{OPROJ}.weight_scale",
            lambda t: torch.cat([t, t[:, :1]], 1),
            r"shape \[512, 17\]; expected \[512, 16\] \(N, ceil\(K/32\)\)",
        ),
        (
            f"{OPROJ}.weight_dual_scale",
            lambda t: t.squeeze(-1),
            r"shape \[512, 1\]; expected \[512, 1, 1\] \(N, ceil\(K/512\), 1\)",
        ),
        (
            f"{QPROJ}.weight_dual_scale",
            lambda t: t.repeat(1, 2, 1),
            r"shape \[512, 2, 1\]; expected \[512, 1, 1\]",
        ),
        (
            "blocks.2.ffn.2.div.mul_scale",
            lambda t: t[None, :],
            r"mul_scale 'blocks\.2\.ffn\.2\.div\.mul_scale' has shape \[1, 1024\]; expected \[1024\]",
        ),
        (
            f"{OPROJ}.bias",
            lambda t: t[:-1],
            r"bias 'blocks\.1\.self_attn\.o\.bias' has shape \[511\]; expected \[512\]",
        ),
        (
            "blocks.0.norm3.weight",
            lambda t: t[:-1],
            r"FLOAT tensor 'blocks\.0\.norm3\.weight' has shape \[511\]; expected \[512\]",
        ),
    ],
)
def test_shapes_must_match_the_original_linear(expert_copy, tmp_path, name, value, message):
    assert_refused(expert_copy, tmp_path, message, replace(name, value))


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            f"{OPROJ}.weight",
            lambda t: t.view(torch.int8),
            r"weight 'blocks\.1\.self_attn\.o\.weight' has dtype I8; expected U8",
        ),
        (f"{OPROJ}.weight", lambda t: t.float(), r"has dtype F32; expected U8"),
        (f"{OPROJ}.weight_scale", lambda t: t.float(), r"weight_scale '.*' has dtype F32; expected U8"),
        (
            f"{OPROJ}.weight_dual_scale",
            lambda t: t.bfloat16(),
            r"weight_dual_scale '.*' has dtype BF16; expected F32",
        ),
        (
            "blocks.2.ffn.2.div.mul_scale",
            lambda t: t.to(torch.int32),
            r"mul_scale '.*' has dtype I32; expected BF16 or F16 or F32",
        ),
        (
            "blocks.0.norm3.weight",
            lambda t: t.to(torch.int16),
            r"FLOAT tensor 'blocks\.0\.norm3\.weight' has dtype I16",
        ),
        (f"{OPROJ}.bias", lambda t: t.to(torch.int32), r"bias 'blocks\.1\.self_attn\.o\.bias' has dtype I32"),
    ],
)
def test_wrong_dtypes(expert_copy, tmp_path, name, value, message):
    assert_refused(expert_copy, tmp_path, message, replace(name, value))


def test_e8m0_nan_scale(expert_copy, tmp_path):
    def nan_code(t):
        t = t.clone()
        t[3, 5] = 0xFF
        return t

    message = rf"weight_scale '{QPROJ}\.weight_scale' holds 0xFF at \[3, 5\]; expected E8M0 codes"
    assert_refused(expert_copy, tmp_path, message, replace(f"{QPROJ}.weight_scale", nan_code))


@pytest.mark.parametrize(
    ("bad", "shown"), [(math.nan, "nan"), (math.inf, "inf"), (0.0, "0.0"), (-0.5, "-0.5")]
)
def test_mul_scale_must_be_finite_and_positive(expert_copy, tmp_path, bad, shown):
    def poison(t):
        t = t.clone()
        t[7] = bad
        return t

    message = (
        rf"mul_scale 'blocks\.2\.ffn\.2\.div\.mul_scale' holds {shown}.* at \[7\]; expected finite values in "
        r"\[2\^-24, 2\^24\]"
    )
    assert_refused(expert_copy, tmp_path, message, replace("blocks.2.ffn.2.div.mul_scale", poison))


@pytest.mark.parametrize("bad", [math.nan, -1.0])
def test_dual_scale_must_be_finite_and_non_negative(expert_copy, tmp_path, bad):
    def poison(t):
        t = t.clone()
        t[9, 0, 0] = bad
        return t

    message = rf"weight_dual_scale '{OPROJ}\.weight_dual_scale' holds .* at \[9, 0, 0\]; expected finite values >= 0"
    assert_refused(expert_copy, tmp_path, message, replace(f"{OPROJ}.weight_dual_scale", poison))


def test_bias_of_a_quantized_layer_must_be_finite(expert_copy, tmp_path):
    def poison(t):
        t = t.clone()
        t[3] = math.inf
        return t

    message = rf"bias '{OPROJ}\.bias' holds inf at \[3\]; expected finite values"
    assert_refused(expert_copy, tmp_path, message, replace(f"{OPROJ}.bias", poison))


def test_partial_bf16_fallback_in_fused_qkv(expert_copy, tmp_path, dual_export):
    state = dual_export.states["transformer"]

    def k_to_bf16(tensors, entries):
        prefix = "blocks.1.self_attn.k"
        for leaf in (
            "linear.weight",
            "linear.weight_scale",
            "linear.weight_dual_scale",
            "linear.bias",
            "div.mul_scale",
        ):
            del tensors[f"{prefix}.{leaf}"]
            del entries[f"{prefix}.{leaf}"]
        for leaf in ("weight", "bias"):
            tensors[f"{prefix}.{leaf}"] = state[f"blocks.1.attn1.to_k.{leaf}"]
            entries[f"{prefix}.{leaf}"] = "FLOAT"

    message = r"fused blocks\.1\.attn1\.to_qkv \(export blocks\.1\.self_attn\): partial BF16 fallback \(to_q, to_v quantized, to_k BF16\); vLLM-Omni fuses to_q, to_k, to_v into blocks\.1\.attn1\.to_qkv"
    assert_refused(expert_copy, tmp_path, message, k_to_bf16)


def test_qkv_with_different_mul_scale(expert_copy, tmp_path):
    message = r"blocks\.1\.attn1\.to_qkv .*: to_q/to_k/to_v have different mul_scale tensors"
    assert_refused(
        expert_copy, tmp_path, message, replace("blocks.1.self_attn.v.div.mul_scale", lambda t: t * 2)
    )


def test_qkv_with_smooth_on_some_only(expert_copy, tmp_path):
    def unwrap_v(tensors, entries):
        prefix = "blocks.1.self_attn.v"
        del tensors[f"{prefix}.div.mul_scale"]
        del entries[f"{prefix}.div.mul_scale"]
        for leaf in ("weight", "weight_scale", "weight_dual_scale", "bias"):
            tensors[f"{prefix}.{leaf}"] = tensors.pop(f"{prefix}.linear.{leaf}")
            entries[f"{prefix}.{leaf}"] = entries.pop(f"{prefix}.linear.{leaf}")

    assert_refused(
        expert_copy, tmp_path, r"blocks\.1\.attn1\.to_qkv .*: Smooth mul_scale on to_q, to_k only", unwrap_v
    )


def test_duplicate_tensor_across_shards(expert_copy, tmp_path):
    original, quant = expert_copy
    shards = sorted((quant / "low_noise_model").glob("quant_model_weight-*.safetensors"))
    first = load_file(str(shards[0]))
    second = load_file(str(shards[1]))
    name = next(iter(first))
    save_file({**second, name: first[name]}, str(shards[1]))
    message = rf"duplicate tensor '{name}': stored in both .*{shards[0].name} and .*{shards[1].name}"
    assert_refused(expert_copy, tmp_path, message)


def test_index_that_misses_a_shard_tensor(expert_copy, tmp_path):
    original, quant = expert_copy
    index_path = quant / "low_noise_model" / "quant_model_weight.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = sorted(index["weight_map"])[0]
    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    assert_refused(
        expert_copy,
        tmp_path,
        rf"quant_model_weight\.safetensors\.index\.json: tensor '{name}' in .* is not listed",
    )


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda t, e: (
                t.__setitem__("blocks.1.self_attn.out.bias", t.pop(f"{OPROJ}.bias")),
                e.__setitem__("blocks.1.self_attn.out.bias", e.pop(f"{OPROJ}.bias")),
            ),
            r"unknown tensor 'blocks\.1\.self_attn\.out\.bias'; it is not in the exact Wan2\.2 original-name table",
        ),
        (
            lambda t, e: (
                t.__setitem__("blocks.7.modulation", t.pop("blocks.2.modulation")),
                e.__setitem__("blocks.7.modulation", e.pop("blocks.2.modulation")),
            ),
            r"tensor 'blocks\.7\.modulation' maps to 'blocks\.7\.scale_shift_table', which the original transformer lacks",
        ),
        (
            lambda t, e: e.__setitem__("blocks.9.ffn.0.weight", "FLOAT"),
            r"describes tensor 'blocks\.9\.ffn\.0\.weight', which no weight file holds",
        ),
        (
            lambda t, e: e.pop("blocks.0.norm3.bias"),
            r"tensor 'blocks\.0\.norm3\.bias' has no label in quant_model_description",
        ),
        (
            lambda t, e: e.__setitem__("model_quant_type", "W4A4_MXFP4"),
            r"model_quant_type 'W4A4_MXFP4' disagrees with the tensor labels",
        ),
        (
            lambda t, e: [
                e.__setitem__(f"{OPROJ}.{leaf}", "W4A4_MXFP4") for leaf in ("weight", "weight_scale")
            ],
            r"mixes W4A4_MXFP4 \(e\.g\. '[\w.]+'\) and W4A4_MXFP4_DUALSCALE \(e\.g\. '[\w.]+'\)",
        ),
        (
            lambda t, e: e.__setitem__("blocks.0.norm3.weight", "W4A4_MXFP4_DUALSCALE"),
            r"'blocks\.0\.norm3\.weight' is labelled W4A4_MXFP4_DUALSCALE but is not part of a quantized Linear",
        ),
        (
            lambda t, e: e.__setitem__("blocks.1.self_attn.q.linear.weight_scale", "FLOAT"),
            r"weight_scale 'blocks\.1\.self_attn\.q\.linear\.weight_scale' is labelled FLOAT; expected W4A4_MXFP4_DUALSCALE",
        ),
        (
            lambda t, e: (
                t.__setitem__(f"{OPROJ}.linear.weight", t.pop(f"{OPROJ}.weight")),
                e.__setitem__(f"{OPROJ}.linear.weight", e.pop(f"{OPROJ}.weight")),
            ),
            r"\(export blocks\.1\.self_attn\.o\): mixes Smooth-wrapped and plain tensor names",
        ),
        (
            lambda t, e: e.__setitem__("optional", {"quarot": {"rotation_map": {}}}),
            r"unsupported 'optional' section",
        ),
        (
            lambda t, e: e.__setitem__("blocks.0.self_attn.q.weight", "W4A4_MXFP4_DUALSCALE"),
            r"layer blocks\.0\.attn1\.to_q \(export blocks\.0\.self_attn\.q\): quantized \(W4A4_MXFP4_DUALSCALE\) but blocks\.0\.self_attn\.q\.weight_scale is missing",
        ),
    ],
)
def test_inconsistent_exports(expert_copy, tmp_path, mutate, message):
    assert_refused(expert_copy, tmp_path, message, mutate)


def test_unexpected_safetensors_file(expert_copy, tmp_path):
    original, quant = expert_copy
    save_file({"x": torch.zeros(1)}, str(quant / "high_noise_model" / "extra.safetensors"))
    assert_refused(
        expert_copy, tmp_path, r"high_noise_model: unexpected safetensors file\(s\) \['extra\.safetensors'\]"
    )


def test_original_that_is_already_quantized(expert_copy, tmp_path):
    original, quant = expert_copy
    path = original / "transformer_2" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    assert_refused(expert_copy, tmp_path, r"transformer_2/config\.json: already has a quantization_config")


def test_output_path_rules(expert_copy, tmp_path):
    original, quant = expert_copy
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(CheckpointError, match=rf"output path {out} exists; pass --overwrite"):
        merge_t2v(original, quant, out)
    assert (out / "old.txt").read_text() == "old"
    merge_t2v(original, quant, out, overwrite=True)
    assert not (out / "old.txt").exists() and (out / "transformer" / "config.json").is_file()
    for target in (original / "merged", quant, quant / "high_noise_model" / "x", tmp_path):
        with pytest.raises(CheckpointError, match=r"output path .* overlaps the input"):
            merge_t2v(original, quant, target, overwrite=True)
    with pytest.raises(
        CheckpointError, match=r"parent directory of the output path, .*missing, does not exist"
    ):
        merge_t2v(original, quant, tmp_path / "missing" / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["orig", "out", "quant"]


def test_cli_reports_validation_errors_in_one_line(expert_copy, tmp_path, capsys):
    original, quant = expert_copy
    edit(quant / "high_noise_model", relabel(f"{OPROJ}.weight_scale", "W8A8_DYNAMIC"))
    argv = ["merge", "--model-type", "Wan2.2-T2V-A14B", "--original-model", str(original)]
    argv += ["--quant-path", str(quant), "--output-path", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert f"'{OPROJ}.weight_scale' has unsupported description label 'W8A8_DYNAMIC'" in err
    assert not (tmp_path / "out").exists()


def test_failure_while_writing_leaves_nothing(expert_copy, tmp_path, monkeypatch, capsys):
    import vllm_omni_mxfp4.publish.output as merge_module  # the write loop the merge and convert share

    original, quant = expert_copy
    calls = []
    real = merge_module.write_checkpoint

    def failing(directory, *args, **kwargs):
        calls.append(directory)
        if len(calls) == 2:  # the first transformer is written, the second fails
            raise OSError(28, "No space left on device")
        return real(directory, *args, **kwargs)

    monkeypatch.setattr(merge_module, "write_checkpoint", failing)
    argv = ["merge", "--model-type", "auto", "--original-model", str(original), "--quant-path", str(quant)]
    argv += ["--output-path", str(tmp_path / "out")]
    assert main(argv) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert len(calls) == 2 and calls[0].name == "transformer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["orig", "quant"]
