"""``vllm-omni-mxfp4 convert`` on the producers' own NVFP4 checkpoints, and each refusal.

Inputs: ModelOpt's exports of a tiny diffusers Wan2.2 transformer (the committed fixtures: flat
config, mixed NVFP4/FP8, W4A16, swizzled) and compressed-tensors' packing. Expected values come
from independent paths: ``quantize_mx`` of the exact float32 dequant (the requantization under
``floor`` equals it, tests/formats/test_requant.py), the producers' stored bytes, and golden configs.
Each refusal starts from a valid input and changes one thing; nothing may be written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.nvfp4.checkpoints import MODELOPT_FIXTURES
from tests.support.nvfp4.producers.compressed import ct_config, ct_layer
from vllm_omni_mxfp4 import cli
from vllm_omni_mxfp4.checkpoint import CheckpointError
from vllm_omni_mxfp4.convert import convert
from vllm_omni_mxfp4.formats import quantize_mx
from vllm_omni_mxfp4.formats.nvfp4 import Nvfp4Weight, dequantize_nvfp4
from vllm_omni_mxfp4.formats.requant import requantize_nvfp4

FIXTURES = MODELOPT_FIXTURES
WEIGHTS = "diffusion_pytorch_model.safetensors"
BLOCK_LINEARS = (
    "blocks.0.attn1.to_q",
    "blocks.0.attn1.to_k",
    "blocks.0.attn1.to_v",
    "blocks.0.attn1.to_out.0",
    "blocks.0.attn2.to_q",
    "blocks.0.attn2.to_k",
    "blocks.0.attn2.to_v",
    "blocks.0.attn2.to_out.0",
    "blocks.0.ffn.net.0.proj",
    "blocks.0.ffn.net.2",
)
EMBEDDERS = (
    "condition_embedder.text_embedder.linear_1",
    "condition_embedder.text_embedder.linear_2",
    "condition_embedder.time_embedder.linear_1",
    "condition_embedder.time_embedder.linear_2",
    "condition_embedder.time_proj",
)


def fixture_weight(tensors: dict[str, torch.Tensor], layer: str) -> Nvfp4Weight:
    """A ModelOpt layer as the canonical weight, read straight from its stored tensors."""
    return Nvfp4Weight(
        tensors[f"{layer}.weight"], tensors[f"{layer}.weight_scale"], tensors[f"{layer}.weight_scale_2"]
    )


def copy_export(tmp_path: Path, export: str = "nvfp4") -> Path:
    target = tmp_path / "in"
    shutil.copytree(FIXTURES / export, target)
    return target


def edit(directory: Path, change) -> Path:
    """Rewrite the weights file of ``directory`` with ``change(tensors)`` applied."""
    tensors = load_file(directory / WEIGHTS)
    change(tensors)
    save_file(tensors, str(directory / WEIGHTS), {"format": "pt"})
    return directory


def refused(tmp_path: Path, source: Path, *fragments: str) -> None:
    """The convert refuses ``source`` with all ``fragments`` in the message and leaves nothing."""
    with pytest.raises(CheckpointError) as info:
        convert(source, tmp_path / "out", progress=False)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if "staging" in p.name] == []


def test_modelopt_export_becomes_the_offline_mxfp4_layout(tmp_path: Path) -> None:
    report = convert(FIXTURES / "nvfp4", tmp_path / "out", scale_rule="floor", progress=False)
    src = load_file(FIXTURES / "nvfp4" / WEIGHTS)
    out = load_file(tmp_path / "out" / WEIGHTS)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "mxfp4",
        "is_checkpoint_mxfp4_serialized": True,
        "ignored_layers": [],
        "require_smooth_scale": False,
    }
    assert config["num_layers"] == 1 and config["_class_name"] == "WanTransformer3DModel"
    for layer in BLOCK_LINEARS:
        data, scale = quantize_mx(dequantize_nvfp4(fixture_weight(src, layer)), scale_rule="floor")
        assert torch.equal(out[f"{layer}.weight"], data), layer
        assert torch.equal(out[f"{layer}.weight_scale"], scale), layer
        assert torch.equal(out[f"{layer}.bias"], src[f"{layer}.bias"]), layer
    for layer in EMBEDDERS:  # plain nn.Linear in vLLM-Omni's Wan: the exact dequant in BF16
        expected = dequantize_nvfp4(fixture_weight(src, layer)).to(torch.bfloat16)
        assert torch.equal(out[f"{layer}.weight"], expected), layer
    for name in (
        "proj_out.weight",
        "patch_embedding.weight",
        "blocks.0.scale_shift_table",
        "blocks.0.norm2.bias",
    ):
        assert torch.equal(out[name], src[name]), name
    leftovers = [n for n in out if n.endswith(("input_scale", "weight_scale_2"))]
    assert leftovers == []
    actions = {layer.name: layer.action for layer in report.components[0].layers}
    assert {actions[n] for n in BLOCK_LINEARS} == {"mxfp4"} and {actions[n] for n in EMBEDDERS} == {"bf16"}
    assert actions["proj_out"] == "kept" and actions["patch_embedding"] == "kept"


def test_mse_output_and_error_report_are_the_requantization_of_each_layer(tmp_path: Path) -> None:
    report = convert(FIXTURES / "swizzled", tmp_path / "out", progress=False)
    out = load_file(tmp_path / "out" / WEIGHTS)
    plain = load_file(FIXTURES / "nvfp4" / WEIGHTS)  # the same export before ModelOpt swizzled it
    rows = {layer.name: layer for layer in report.components[0].layers}
    for layer in BLOCK_LINEARS:
        expected = requantize_nvfp4(fixture_weight(plain, layer), "mse")
        assert torch.equal(out[f"{layer}.weight"], expected.data), layer
        assert torch.equal(out[f"{layer}.weight_scale"], expected.scale), layer
        assert rows[layer].rule == "mse"
        assert rows[layer].rel_rms == pytest.approx(expected.error.rel_rms)
        assert rows[layer].total_blocks == expected.error.total_blocks


def test_mixed_checkpoint_fp8_layer_becomes_bf16_and_is_ignored(tmp_path: Path) -> None:
    report = convert(FIXTURES / "mixed", tmp_path / "out", progress=False)
    src = load_file(FIXTURES / "mixed" / WEIGHTS)
    out = load_file(tmp_path / "out" / WEIGHTS)
    fp8 = "blocks.0.ffn.net.2"
    expected = (src[f"{fp8}.weight"].float() * src[f"{fp8}.weight_scale"].float()).to(torch.bfloat16)
    assert torch.equal(out[f"{fp8}.weight"], expected)
    assert f"{fp8}.weight_scale" not in out
    assert report.components[0].ignored_layers == ["blocks.0.ffn.net_2"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["ignored_layers"] == ["blocks.0.ffn.net_2"]
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()  # would say NVFP4 again


def test_w4a16_layers_are_converted_with_a_warning_about_activations(tmp_path: Path) -> None:
    report = convert(FIXTURES / "w4a16", tmp_path / "out", progress=False)
    (warning,) = report.components[0].warnings
    assert (
        "W4A16_NVFP4" in warning and "w4a8_fallback_layers" in warning and "blocks.0.attn1.to_qkv" in warning
    )


def test_a_fused_group_with_a_bf16_member_is_all_bf16(tmp_path: Path) -> None:
    """The producer kept to_q BF16: vLLM-Omni fuses Q/K/V into one Linear, so K and V become BF16."""
    source = copy_export(tmp_path)
    src = load_file(source / WEIGHTS)
    bf16_q = dequantize_nvfp4(fixture_weight(src, "blocks.0.attn1.to_q")).to(torch.bfloat16)

    def keep_q(t):
        for leaf in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            del t[f"blocks.0.attn1.to_q.{leaf}"]
        t["blocks.0.attn1.to_q.weight"] = bf16_q

    edit(source, keep_q)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"]["ignore"].append("blocks.0.attn1.to_q")
    (source / "config.json").write_text(json.dumps(config))
    report = convert(source, tmp_path / "out", progress=False)
    out = load_file(tmp_path / "out" / WEIGHTS)
    rows = {layer.name: layer for layer in report.components[0].layers}
    assert rows["blocks.0.attn1.to_q"].action == "kept"
    for member in ("blocks.0.attn1.to_k", "blocks.0.attn1.to_v"):
        assert (
            rows[member].action == "bf16"
            and "fused at runtime into blocks.0.attn1.to_qkv" in rows[member].reason
        )
        expected = dequantize_nvfp4(fixture_weight(src, member)).to(torch.bfloat16)
        assert torch.equal(out[f"{member}.weight"], expected)
    assert report.components[0].ignored_layers == ["blocks.0.attn1.to_qkv"]
    assert torch.equal(out["blocks.0.attn1.to_q.weight"], bf16_q)


def test_compressed_tensors_layers_requantize_from_their_divisor_global_scale(tmp_path: Path) -> None:
    """compressed-tensors stores ``weight_packed`` and the global scale as a divisor."""
    source = copy_export(tmp_path)
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    packed = ct_layer(weight)

    def to_ct(t):
        for leaf in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            del t[f"blocks.0.attn1.to_out.0.{leaf}"]
        t.update({f"blocks.0.attn1.to_out.0.{k}": v for k, v in packed.items()})
        for name in [n for n in t if n.endswith((".weight_scale_2", ".input_scale"))]:
            del t[name]
        for name in [n for n in t if n.endswith(".weight") and t[n].dtype == torch.uint8]:
            layer = name.rsplit(".", 1)[0]
            dense = dequantize_nvfp4(fixture_weight(load_file(FIXTURES / "nvfp4" / WEIGHTS), layer))
            del t[name], t[f"{layer}.weight_scale"]
            t.update({f"{layer}.{k}": v for k, v in ct_layer(dense.bfloat16()).items()})

    edit(source, to_ct)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = ct_config(["patch_embedding", "proj_out"])
    (source / "config.json").write_text(json.dumps(config))
    (source / "hf_quant_config.json").unlink()
    convert(source, tmp_path / "out", scale_rule="floor", progress=False)
    out = load_file(tmp_path / "out" / WEIGHTS)
    layer = Nvfp4Weight(
        packed["weight_packed"], packed["weight_scale"], packed["weight_global_scale"].reshape(()), True
    )
    data, scale = quantize_mx(dequantize_nvfp4(layer), scale_rule="floor")
    assert torch.equal(out["blocks.0.attn1.to_out.0.weight"], data)
    assert torch.equal(out["blocks.0.attn1.to_out.0.weight_scale"], scale)


def test_pipeline_converts_nvfp4_components_and_copies_the_rest_byte_for_byte(tmp_path: Path) -> None:
    pipeline = tmp_path / "pipe"
    shutil.copytree(FIXTURES / "nvfp4", pipeline / "transformer")
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    (pipeline / "vae").mkdir()
    (pipeline / "vae" / "weights.bin").write_bytes(bytes(range(256)) * 7)
    report = convert(pipeline, tmp_path / "out", max_shard_size=20_000, progress=False)
    assert [c.name for c in report.components] == ["transformer"]
    assert report.copied_files == 2
    assert (tmp_path / "out" / "vae" / "weights.bin").read_bytes() == bytes(range(256)) * 7
    assert (tmp_path / "out" / "model_index.json").read_bytes() == (
        pipeline / "model_index.json"
    ).read_bytes()
    index = json.loads((tmp_path / "out" / "transformer" / f"{WEIGHTS}.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    merged = {}
    for shard in shards:
        merged.update(load_file(tmp_path / "out" / "transformer" / shard))
    assert set(merged) == set(index["weight_map"])
    assert "blocks.0.ffn.net.0.proj.weight_scale" in merged


def test_dry_run_reports_the_plan_and_writes_nothing(tmp_path: Path) -> None:
    report = convert(FIXTURES / "mixed", tmp_path / "out", dry_run=True, progress=False)
    assert report.dry_run and not (tmp_path / "out").exists()
    rows = {layer.name: layer for layer in report.components[0].layers}
    assert rows["blocks.0.attn1.to_q"].action == "mxfp4" and rows["blocks.0.attn1.to_q"].rel_rms is None


def test_svdquant_layer_fails_the_whole_convert_naming_it(tmp_path: Path) -> None:
    source = edit(
        copy_export(tmp_path), lambda t: t.update({"blocks.0.attn2.to_k.proj_down": torch.zeros(4, 64)})
    )
    refused(tmp_path, source, "blocks.0.attn2.to_k", "SVDQuant low-rank branch (proj_down)")


def test_an_unknown_tensor_of_an_nvfp4_layer_is_refused_not_dropped(tmp_path: Path) -> None:
    source = edit(
        copy_export(tmp_path), lambda t: t.update({"blocks.0.attn2.to_k.smooth_bias": torch.zeros(64)})
    )
    refused(tmp_path, source, "blocks.0.attn2.to_k", "'blocks.0.attn2.to_k.smooth_bias'", "has no place")


def test_nan_block_scale_fails_while_writing_and_leaves_no_output(tmp_path: Path) -> None:
    def nan_scale(t):
        scale = t["blocks.0.ffn.net.2.weight_scale"].view(torch.uint8).clone()
        scale[5, 1] = 0x7F
        t["blocks.0.ffn.net.2.weight_scale"] = scale.view(torch.float8_e4m3fn)

    source = edit(copy_export(tmp_path), nan_scale)
    with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.net\.2: NaN block scale in row 5"):
        convert(source, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_a_class_vllm_omni_does_not_have_is_refused_naming_the_config(tmp_path: Path) -> None:
    """A class outside the fixed tables is looked up in vLLM-Omni (tests/convert/test_convert_models.py);
    one vLLM-Omni does not have cannot be served, so nothing is written."""
    source = copy_export(tmp_path)
    config = json.loads((source / "config.json").read_text())
    config["_class_name"] = "HunyuanVideoTransformer3DModel"
    (source / "config.json").write_text(json.dumps(config))
    refused(
        tmp_path,
        source,
        "config.json",
        "'HunyuanVideoTransformer3DModel'",
        "no vLLM-Omni diffusion model class",
    )


def test_a_directory_without_nvfp4_is_refused(tmp_path: Path) -> None:
    source = copy_export(tmp_path)
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    (source / "config.json").write_text(json.dumps(config))
    (source / "hf_quant_config.json").unlink()
    refused(tmp_path, source, "nothing declares NVFP4")


def test_cli_json_report_and_refusal_status(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["convert", "--input", str(FIXTURES / "mixed"), "--output", str(tmp_path / "out"), "--json"]
    assert cli.main([*argv, "--scale-rule", "even"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["scale_rule"] == "even"
    assert report["components"][0]["ignored_layers"] == ["blocks.0.ffn.net_2"]
    assert cli.main(argv) == 2
    failure = json.loads(capsys.readouterr().out)
    assert not failure["ok"] and "exists; pass --overwrite" in failure["error"]


def test_cli_summary_names_each_layer_with_its_rule_and_error(tmp_path: Path, capsys) -> None:
    argv = ["convert", "--input", str(FIXTURES / "nvfp4"), "--output", str(tmp_path / "out")]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "WanTransformer3DModel NVFP4 by modelopt: 10 MXFP4, 5 BF16, 7 kept as stored" in text
    assert "    blocks.0.attn1.to_q: mxfp4 (mse) rel_rms=" in text
    assert "    proj_out: kept (excluded by ignore pattern 'proj_out')" in text
