"""``vllm-omni-mxfp4 inspect``: valid checkpoints described layer by layer, bad ones refused by name.

Checkpoints: the tiny two-block Wan2.2 model (BF16), offline ``mxfp4`` (Smooth on Q/K/V and
``ffn.net.2``) and ``mxfp4_dualscale`` checkpoints written from it with the formats core
(``tests/support/layers.py``), and the ModelOpt NVFP4 exports kept as fixtures in
``tests/support/nvfp4/fixtures``. Every bad checkpoint is built from a valid one by one edit, and each test
asserts that the problem names the layer and the tensor. Expected shapes come from the tiny model's
config (inner dim 512, FFN 1024), the plain ``nn.Linear`` list from the model table, which
``tests/models`` measures on a real build.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.layers import checkpoint_variant, mxfp8_dir, offline_dirs
from tests.support.models import table_tool
from tests.support.nvfp4.checkpoints import MODELOPT_FIXTURES
from vllm_omni_mxfp4.cli import main
from vllm_omni_mxfp4.inspection import format_table, inspect_path

__all__ = ["mxfp8_dir", "offline_dirs"]  # module fixtures

pytestmark = pytest.mark.omni
pytest.importorskip(
    "vllm_omni", reason="vllm / vllm-omni not installed: inspect builds vLLM-Omni's model classes"
)

FIXTURES = MODELOPT_FIXTURES
QKV = "blocks.0.attn1.to_qkv"


def rows(component) -> dict:
    return {row.name: row for row in component.layers}


def only(report):
    (component,) = report.components
    return component


def assert_problem(report, layer: str, *fragments: str) -> None:
    """Exactly one problem names ``layer`` and contains every fragment (regular expressions)."""
    assert not report.ok
    found = [p for p in report.problems if re.search(rf"(^|: ){re.escape(layer)}(: |\.)", p)]
    assert found, f"no problem names {layer}: {report.problems}"
    for fragment in fragments:
        assert any(re.search(fragment, p) for p in found), f"{fragment!r} not in {found}"


# ------------------------------------------------------------------------------ valid checkpoints


def test_offline_mxfp4_checkpoint_is_described_per_runtime_linear(offline_dirs):
    report = inspect_path(offline_dirs["mxfp4"])
    assert report.ok, report.problems
    component = only(report)
    assert (component.name, component.class_name) == ("transformer", "WanTransformer3DModel")
    assert (component.method, component.mode) == ("mxfp4", "offline")
    assert component.facts["is_checkpoint_mxfp4_serialized"] is True
    by_name = rows(component)
    qkv = by_name[QKV]
    assert (qkv.method, qkv.precision, qkv.smooth, qkv.shape) == ("mxfp4", "w4a4", True, (1536, 512))
    assert qkv.sources == [f"blocks.0.attn1.to_{p}" for p in "qkv"]
    pieces = {(t.name, t.dtype, t.shape, t.piece) for t in qkv.tensors if t.role == "weight"}
    assert pieces == {(f"blocks.0.attn1.to_{p}.weight", "U8", (512, 256), i) for i, p in enumerate("qkv")}
    ffn = by_name["blocks.1.ffn.net_2"]
    assert (ffn.smooth, ffn.shape, ffn.sources) == (True, (512, 1024), ["blocks.1.ffn.net.2"])
    assert {t.role: (t.dtype, t.shape) for t in ffn.tensors} == {
        "weight": ("U8", (512, 512)),
        "weight_scale": ("U8", (512, 32)),
        "mul_scale": ("F32", (1024,)),
        "bias": ("BF16", (512,)),
    }
    assert by_name["blocks.0.attn1.to_out"].smooth is False
    plain = sorted(name for name, row in by_name.items() if row.kind == "plain")
    assert plain == table_tool().MEASURED["wan2_2.WanTransformer3DModel"]["plain"]
    assert all(by_name[name].method == "bf16" for name in plain)
    assert sum(row.method == "mxfp4" for row in component.layers) == 16


def test_offline_dualscale_checkpoint(offline_dirs):
    report = inspect_path(offline_dirs["mxfp4_dualscale"])
    assert report.ok, report.problems
    ffn = rows(only(report))["blocks.1.ffn.net_2"]
    assert (ffn.method, ffn.precision, ffn.smooth) == ("mxfp4_dualscale", "w4a4", True)
    roles = {t.role: (t.dtype, t.shape) for t in ffn.tensors}
    assert roles["weight_dual_scale"] == ("F32", (512, 2, 1))


def test_bf16_model_lists_what_online_quantization_would_quantize(tiny_dir):
    report = inspect_path(tiny_dir, component="transformer_2")
    assert report.ok, report.problems
    component = only(report)
    assert component.method is None and "no quantization_config" in component.source
    assert any("what online --quantization mxfp4 would quantize" in note for note in component.notes)
    quantized = sorted(row.name for row in component.layers if row.method == "mxfp4")
    assert len(quantized) == table_tool().MEASURED["wan2_2.WanTransformer3DModel"]["quantized"]
    assert QKV in quantized and "proj_out" not in quantized
    weight = [t for t in rows(component)[QKV].tensors if t.role == "weight"]
    assert {(t.dtype, t.shape) for t in weight} == {("BF16", (512, 512))} and len(weight) == 3


def test_another_model_class_qwen_image(tmp_path):
    """Nothing Wan-specific: a tiny diffusers Qwen-Image transformer (saved by diffusers itself)
    gets the fused pieces and BF16 reasons of vLLM-Omni's own class."""
    from diffusers import QwenImageTransformer2DModel

    from tests.support.models import QWEN_IMAGE

    torch.manual_seed(0)
    QwenImageTransformer2DModel(**QWEN_IMAGE.config).to(torch.bfloat16).save_pretrained(tmp_path / "qwen")
    report = inspect_path(tmp_path / "qwen")
    assert report.ok, report.problems
    by_name = rows(only(report))
    block = "transformer_blocks.1"
    assert by_name[f"{block}.attn.to_qkv"].sources == [f"{block}.attn.to_{p}" for p in "qkv"]
    assert by_name[f"{block}.attn.add_kv_proj"].sources == [f"{block}.attn.add_{p}_proj" for p in "qkv"]
    assert by_name[f"{block}.attn.add_kv_proj"].method == "mxfp4"
    default = by_name[f"{block}.txt_mlp.net.2"]
    assert (
        default.method == "bf16" and "kept BF16 by the QwenImageTransformer2DModel default" in default.reason
    )
    assert by_name[f"{block}.img_mod.1"].reason == "the model builds it without a quantization config"


@pytest.mark.parametrize(
    "fixture, layer, method, precision, reason",
    [
        ("nvfp4", "blocks.0.ffn.net_2", "mxfp4", "w4a4", "requantized to MXFP4"),
        ("w4a16", "blocks.0.ffn.net_2", "mxfp4", "w4a8", "W4A16_NVFP4"),
        ("mixed", "blocks.0.ffn.net_2", "bf16", "bf16", "FP8"),
    ],
)
def test_nvfp4_exports_are_detected_and_described(fixture, layer, method, precision, reason):
    report = inspect_path(FIXTURES / fixture)
    assert report.ok, report.problems
    component = only(report)
    assert component.source.startswith("NVFP4 checkpoint by modelopt")
    row = rows(component)[layer]
    assert (row.method, row.precision) == (method, precision)
    assert reason in row.reason
    assert rows(component)["proj_out"].method == "bf16"


def test_mxfp8_layers_of_an_offline_checkpoint(mxfp8_dir, tmp_path):
    """Block 0 stored as MXFP8 W8A8 (listed in mxfp8_layers), block 1 MXFP4; then a NaN code."""
    report = inspect_path(mxfp8_dir)
    assert report.ok, report.problems
    by_name = rows(only(report))
    fp8 = by_name["blocks.0.attn2.to_q"]
    assert (fp8.method, fp8.precision, fp8.label, fp8.smooth) == ("mxfp8", "w8a8", "W8A8", None)
    assert {t.role: (t.dtype, t.shape) for t in fp8.tensors} == {
        "weight": ("F8_E4M3", (512, 512)),
        "weight_scale": ("U8", (512, 16)),
        "bias": ("BF16", (512,)),
    }
    assert (by_name["blocks.1.attn2.to_q"].method, by_name["blocks.1.attn2.to_q"].precision) == (
        "mxfp4",
        "w4a4",
    )

    def nan_code(data):
        codes = data["blocks.0.attn2.to_q.weight"].view(torch.uint8).clone()
        codes[3, 5] = 0x7F
        data["blocks.0.attn2.to_q.weight"] = codes.view(torch.float8_e4m3fn)

    bad = checkpoint_variant(mxfp8_dir, tmp_path / "m", tensors=nan_code)
    assert_problem(
        inspect_path(bad), "blocks.0.attn2.to_q", r"blocks\.0\.attn2\.to_q\.weight: holds 0x7F at \[3, 5\]"
    )


def test_converted_nvfp4_checkpoint_is_offline_mxfp4(tmp_path):
    """``vllm-omni-mxfp4 convert``'s output: offline mxfp4 that auto-detection picks, the FP8 layer of
    the mixed export kept BF16 and listed in ignored_layers."""
    from vllm_omni_mxfp4.convert import convert

    convert(FIXTURES / "mixed", tmp_path / "converted")
    report = inspect_path(tmp_path / "converted")
    assert report.ok, report.problems
    component = only(report)
    assert (component.method, component.mode) == ("mxfp4", "offline")
    by_name = rows(component)
    assert (by_name[QKV].method, by_name[QKV].precision) == ("mxfp4", "w4a4")
    assert {t.role: t.dtype for t in by_name[QKV].tensors} == {
        "weight": "U8",
        "weight_scale": "U8",
        "bias": "BF16",
    }
    ffn = by_name["blocks.0.ffn.net_2"]
    assert (ffn.method, ffn.reason) == ("bf16", "listed in ignored_layers")
    assert {t.role: t.dtype for t in ffn.tensors} == {"weight": "BF16", "bias": "BF16"}


def test_a_layer_kept_bf16_and_listed_in_ignored_layers_is_valid(offline_dirs, tiny_dir, tmp_path):
    model = _bf16_layer(offline_dirs["mxfp4"], tiny_dir, tmp_path / "bf16_layer")
    report = inspect_path(model)
    assert report.ok, report.problems
    row = rows(only(report))["blocks.0.attn2.to_k"]
    assert (row.method, row.reason) == ("bf16", "listed in ignored_layers")


def _bf16_layer(src: Path, tiny: Path, dst: Path) -> Path:
    """``src`` with ``blocks.0.attn2.to_k`` taken back from the BF16 original and listed in
    ``ignored_layers``: a valid checkpoint with a BF16 entry."""
    from safetensors.torch import load_file

    original = load_file(str(tiny / "transformer" / "diffusion_pytorch_model.safetensors"))

    def tensors(data):
        for leaf in ("weight_scale", "mul_scale"):
            data.pop(f"blocks.0.attn2.to_k.{leaf}", None)
        data["blocks.0.attn2.to_k.weight"] = original["blocks.0.attn2.to_k.weight"]

    def config(data):
        data["quantization_config"]["ignored_layers"] = ["blocks.0.attn2.to_k"]

    return checkpoint_variant(src, dst, config=config, tensors=tensors)


# ------------------------------------------------------------------------------ bad checkpoints


def _set(name, index, value):
    def edit(data):
        data[name] = data[name].clone()
        data[name][index] = value

    return edit


def _drop(name):
    def edit(data):
        del data[name]

    return edit


def _retype(name, dtype):
    def edit(data):
        data[name] = data[name].to(dtype)

    return edit


def test_scale_code_0xff_is_named(offline_dirs, tmp_path):
    bad = checkpoint_variant(
        offline_dirs["mxfp4"], tmp_path / "m", tensors=_set("blocks.0.attn1.to_k.weight_scale", (2, 1), 0xFF)
    )
    report = inspect_path(bad)
    assert_problem(
        report, QKV, r"blocks\.0\.attn1\.to_k\.weight_scale: holds 0xFF at \[2, 1\]", r"E8M0 codes <= 253"
    )
    assert len(report.problems) == 1


def test_missing_weight_scale_is_named(offline_dirs, tmp_path):
    bad = checkpoint_variant(
        offline_dirs["mxfp4"], tmp_path / "m", tensors=_drop("blocks.1.ffn.net.2.weight_scale")
    )
    report = inspect_path(bad)
    assert_problem(
        report,
        "blocks.1.ffn.net_2",
        r"blocks\.1\.ffn\.net\.2\.weight_scale: missing",
        r"U8 \(N, ceil\(K/32\)\)",
    )
    assert len(report.problems) == 1


def test_wrong_dtype_is_named(offline_dirs, tmp_path):
    name = "blocks.1.attn2.to_v.weight_dual_scale"
    bad = checkpoint_variant(
        offline_dirs["mxfp4_dualscale"], tmp_path / "m", tensors=_retype(name, torch.float16)
    )
    assert_problem(
        inspect_path(bad),
        "blocks.1.attn2.to_v",
        rf"{re.escape(name)}: has dtype F16; expected F32 \(weight_dual_scale: F32 ",
    )


def test_dual_scale_nan_is_named(offline_dirs, tmp_path):
    name = "blocks.0.ffn.net.0.proj.weight_dual_scale"
    bad = checkpoint_variant(
        offline_dirs["mxfp4_dualscale"], tmp_path / "m", tensors=_set(name, (7, 0, 0), float("nan"))
    )
    assert_problem(
        inspect_path(bad), "blocks.0.ffn.net_0.proj", rf"{re.escape(name)}: holds nan at \[7, 0, 0\]"
    )


def test_quantized_layer_listed_as_ignored_is_named(offline_dirs, tmp_path):
    def config(data):
        data["quantization_config"]["ignored_layers"] = ["blocks.1.attn2.to_out"]

    bad = checkpoint_variant(offline_dirs["mxfp4"], tmp_path / "m", config=config)
    assert_problem(
        inspect_path(bad),
        "blocks.1.attn2.to_out",
        r"blocks\.1\.attn2\.to_out\.0\.weight: U8 \[512, 256\], a packed quantized weight",
        "a quantized layer listed as ignored: remove it from ignored_layers",
    )


def test_quantized_checkpoint_without_quantization_config(offline_dirs, tmp_path):
    def config(data):
        del data["quantization_config"]

    report = inspect_path(checkpoint_variant(offline_dirs["mxfp4"], tmp_path / "m", config=config))
    assert_problem(
        report,
        "blocks.0.ffn.net_2",
        r"blocks\.0\.ffn\.net\.2\.weight: U8 \[512, 512\], a packed quantized weight",
        "config.json has no quantization_config: add the one the merge writes",
    )
    # every quantized diffusers Linear, once: 10 per block (Q, K, V, out, 4 cross-attention, 2 FFN)
    assert len([p for p in report.problems if "packed quantized weight" in p]) == 20


def test_bf16_entry_without_a_bf16_weight_is_named(offline_dirs, tiny_dir, tmp_path):
    valid = _bf16_layer(offline_dirs["mxfp4"], tiny_dir, tmp_path / "valid")
    bad = checkpoint_variant(valid, tmp_path / "bad", tensors=_drop("blocks.0.attn2.to_k.weight"))
    assert_problem(
        inspect_path(bad),
        "blocks.0.attn2.to_k",
        r"blocks\.0\.attn2\.to_k\.weight: missing; this Linear loads a BF16 weight of shape \[512, 512\]",
    )


def test_ignored_layers_entry_that_names_no_linear(offline_dirs, tmp_path):
    def config(data):
        data["quantization_config"]["ignored_layers"] = ["blocks.7.attn2.to_q"]  # 2 blocks

    bad = checkpoint_variant(offline_dirs["mxfp4"], tmp_path / "m", config=config)
    report = inspect_path(bad)
    assert any(
        re.search(
            r"config\.json quantization_config: ignored_layers entry 'blocks\.7\.attn2\.to_q' of the "
            r"checkpoint's config\.json names neither a Linear nor a module without Linears",
            p,
        )
        for p in report.problems
    ), report.problems


def test_malformed_json_is_named(offline_dirs, tmp_path):
    bad = checkpoint_variant(offline_dirs["mxfp4"], tmp_path / "m")
    (bad / "transformer" / "config.json").write_text('{"_class_name": ')
    report = inspect_path(bad)
    assert report.problems == [
        f"transformer: {bad / 'transformer' / 'config.json'}: not valid JSON (Expecting value: line 1 column 17 (char 16))"
    ]
    (bad / "model_index.json").write_text("[]")
    assert inspect_path(bad).problems == [f"{bad / 'model_index.json'}: expected a JSON object, found list"]


def test_quantized_plain_linear_is_named(offline_dirs, tmp_path):
    """proj_out is a plain nn.Linear in vLLM-Omni's Wan: a packed weight there cannot load."""
    from vllm_omni_mxfp4.formats import quantize_mx

    def quantize_proj_out(data):
        data["proj_out.weight"], data["proj_out.weight_scale"] = quantize_mx(data["proj_out.weight"])

    bad = checkpoint_variant(offline_dirs["mxfp4"], tmp_path / "m", tensors=quantize_proj_out)
    report = inspect_path(bad)
    assert_problem(
        report,
        "proj_out",
        r"proj_out\.weight: U8 \[64, 256\], a packed quantized weight, where a BF16 weight of shape \[64, 512\]",
        "plain nn.Linear, which runs in BF16 only",
    )
    assert_problem(
        report, "proj_out", r"proj_out\.weight_scale: a weight_scale tensor for a Linear that loads a BF16"
    )


def test_tensor_of_another_format_is_named(offline_dirs, tmp_path):
    """A DualScale tensor in a single-scale mxfp4 checkpoint (a DualScale checkpoint relabelled)."""
    name = "blocks.1.attn2.to_q.weight_dual_scale"
    bad = checkpoint_variant(
        offline_dirs["mxfp4"], tmp_path / "m", tensors=lambda data: data.update({name: torch.ones(512, 1, 1)})
    )
    assert_problem(
        inspect_path(bad),
        "blocks.1.attn2.to_q",
        rf"{re.escape(name)}: weight_dual_scale is not a tensor of a mxfp4 Linear \(it has weight, weight_scale, mul_scale, bias\)",
    )


@pytest.mark.parametrize("value", [1e30, 1e38])
def test_a_smooth_factor_outside_the_calibrated_range_is_named(offline_dirs, tmp_path, value):
    name = "blocks.1.ffn.net.2.mul_scale"
    bad = checkpoint_variant(offline_dirs["mxfp4"], tmp_path / "m", tensors=_set(name, 3, value))
    assert_problem(
        inspect_path(bad),
        "blocks.1.ffn.net_2",
        rf"{re.escape(name)}: holds [0-9.e+]+ at \[3\]; expected finite values in \[2\^-24, 2\^24\]",
    )


def _numeric(data):
    """The numeric weight layout (``merge --weight-layout numeric``): E2M1 values as BF16 (N, K)."""
    from vllm_omni_mxfp4.formats import e2m1_decode, unpack_fp4

    for name in [n for n in data if n.endswith(".weight") and data[n].dtype == torch.uint8]:
        data[name] = e2m1_decode(unpack_fp4(data[name]), torch.bfloat16)


def test_the_numeric_weight_layout_is_valid(offline_dirs, tmp_path):
    """What the merge writes with --weight-layout numeric (and vLLM-Omni's single-scale importer)."""
    for method in ("mxfp4", "mxfp4_dualscale"):
        report = inspect_path(checkpoint_variant(offline_dirs[method], tmp_path / method, tensors=_numeric))
        assert report.ok, report.problems


def test_a_numeric_weight_off_the_e2m1_grid_is_named(offline_dirs, tmp_path):
    name = "blocks.1.attn2.to_k.weight"

    def edit(data):
        _numeric(data)
        _set(name, (3, 70), 0.75)(data)  # exact in BF16, between 0.5 and 1

    bad = checkpoint_variant(offline_dirs["mxfp4"], tmp_path / "m", tensors=edit)
    assert_problem(
        inspect_path(bad),
        "blocks.1.attn2.to_k",
        rf"{re.escape(name)}: holds 0\.75 at \[3, 70\]; expected FP4 E2M1 numbers",
    )


def test_fused_pieces_with_different_smooth_vectors(offline_dirs, tmp_path):
    bad = checkpoint_variant(
        offline_dirs["mxfp4"], tmp_path / "m", tensors=_set("blocks.1.attn1.to_v.mul_scale", 3, 2.0)
    )
    assert_problem(
        inspect_path(bad), "blocks.1.attn1.to_qkv", r"blocks\.1\.attn1\.to_v\.mul_scale: differs from"
    )


# ------------------------------------------------------------------------------ the CLI


def test_cli_json_is_the_whole_stdout_and_matches_the_table(offline_dirs):
    """The real command: stdout is the JSON report alone (vLLM's logs go to stderr), exit 0."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_omni_mxfp4.cli",
            "inspect",
            str(offline_dirs["mxfp4_dualscale"]),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(done.stdout)
    assert data["ok"] and data["problems"] == []
    (component,) = data["components"]
    table = format_table(inspect_path(offline_dirs["mxfp4_dualscale"]))
    for linear in component["linears"]:
        line = next(line for line in table.splitlines() if line.split()[:1] == [linear["name"]])
        size = f"{linear['shape'][0]}x{linear['shape'][1]}"
        assert line.split()[1:4] == [size, linear["method"], linear["precision"].upper()]
    assert component["summary"] in table


def test_cli_exit_statuses(offline_dirs, tmp_path, capfd):
    bad = checkpoint_variant(
        offline_dirs["mxfp4_dualscale"],
        tmp_path / "m",
        tensors=_drop("blocks.0.attn2.to_q.weight_dual_scale"),
    )
    assert main(["inspect", str(bad)]) == 2
    out = capfd.readouterr().out
    assert "problem: blocks.0.attn2.to_q: blocks.0.attn2.to_q.weight_dual_scale: missing" in out
    assert out.rstrip().splitlines()[-1].endswith("1 component(s) inspected, 1 problem")

    assert main(["inspect", str(tmp_path / "nowhere")]) == 1
    assert "nowhere: not a directory" in capfd.readouterr().err


def test_component_option(offline_dirs, tmp_path):
    pipeline = tmp_path / "p"
    shutil.copytree(offline_dirs["mxfp4"], pipeline)
    with pytest.raises(FileNotFoundError, match="no component 'transformer_2'; found transformer"):
        inspect_path(pipeline, component="transformer_2")
