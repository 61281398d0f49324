"""Merging real msModelSlim output: exact bytes, names, configs and dequantized values."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vllm_omni_mxfp4.checkpoint import CheckpointError, merge
from vllm_omni_mxfp4.cli import main

from ..formats.reference import CODE_VALUES
from .conftest import EXPERTS
from .producer import ExpertSpec, original_name, quantize_expert

REPO = Path(__file__).resolve().parents[2]
E2M1 = torch.tensor(CODE_VALUES, dtype=torch.float64)

# Written by hand from the fixture specs (conftest.DUAL_SPECS / SINGLE_SPECS).
NON_BLOCK = [
    "condition_embedder.text_embedder.linear_1",
    "condition_embedder.text_embedder.linear_2",
    "condition_embedder.time_embedder.linear_1",
    "condition_embedder.time_embedder.linear_2",
    "condition_embedder.time_proj",
    "proj_out",
]


def _whole_block(i: int) -> list[str]:
    return [
        f"blocks.{i}.attn1.to_out",
        f"blocks.{i}.attn1.to_qkv",
        f"blocks.{i}.attn2.to_k",
        f"blocks.{i}.attn2.to_out",
        f"blocks.{i}.attn2.to_q",
        f"blocks.{i}.attn2.to_v",
        f"blocks.{i}.ffn.net_0.proj",
        f"blocks.{i}.ffn.net_2",
    ]


EXPECTED_IGNORED = {
    "dual": {
        "transformer": [*_whole_block(0), "blocks.2.attn2.to_k", "blocks.2.attn2.to_v", *NON_BLOCK],
        "transformer_2": [*_whole_block(1), *NON_BLOCK],
    },
    "single": {
        "transformer": [*_whole_block(2), *NON_BLOCK],
        "transformer_2": [*_whole_block(0), *NON_BLOCK],
    },
}


def _load_dir(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        loaded = load_file(str(path))
        assert not set(loaded) & set(tensors)
        tensors.update(loaded)
    return tensors


def _export_labels(directory: Path) -> dict[str, str]:
    (description,) = directory.glob("quant_model_description*.json")
    entries = json.loads(description.read_text())
    return {
        k: v for k, v in entries.items() if isinstance(v, str) and k != "model_quant_type" and k != "version"
    }


def _diffusers_names(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """original Wan tensor name -> diffusers name, from the fixture's own mapping."""
    return {original_name(name): name for name in state}


def _expected_name(export_name: str, names: dict[str, str]) -> str:
    stripped = re.sub(r"\.linear\.(weight|weight_scale|weight_dual_scale|bias)$", r".\1", export_name)
    stripped = re.sub(r"\.div\.mul_scale$", ".mul_scale", stripped)
    layer, leaf = stripped.rsplit(".", 1)
    if stripped in names:
        return names[stripped]
    return names[f"{layer}.weight"][: -len("weight")] + leaf


def _decode(weight: torch.Tensor, scale: torch.Tensor, dual: torch.Tensor | None) -> torch.Tensor:
    """Float64 dequantization, written independently of the package: low nibble = even column."""
    codes = torch.stack((weight & 0xF, weight >> 4), dim=-1).reshape(weight.shape[0], -1).long()
    values = E2M1[codes]
    k = values.shape[1]
    values = values * torch.exp2(scale.double() - 127).repeat_interleave(32, dim=1)[:, :k]
    if dual is not None:
        values = values * dual.double().squeeze(-1).repeat_interleave(512, dim=1)[:, :k]
    return values


@pytest.mark.parametrize("folder", list(EXPERTS))
def test_output_holds_exactly_the_exported_bytes(merged_dual, dual_export, folder):
    out, report = merged_dual
    exported = _load_dir(dual_export.quant / EXPERTS[folder])
    merged = _load_dir(out / folder)
    state = dual_export.states[folder]
    names = _diffusers_names(state)
    expected_names = set(state)
    for export_name, tensor in exported.items():
        name = _expected_name(export_name, names)
        expected_names.add(name)
        got = merged[name]
        if export_name.endswith(".div.mul_scale"):
            assert tensor.dtype == torch.bfloat16  # msModelSlim stores the Smooth scale in the model dtype
            assert got.dtype == torch.float32 and torch.equal(got, tensor.float())
        else:
            assert got.dtype == tensor.dtype, name
            assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), name
    # DualScale layers msModelSlim did not smooth get an identity Smooth (the runtime requires one).
    identity = {n for n in set(merged) - expected_names if n.endswith(".mul_scale")}
    assert identity == {
        f"{n[: -len('.weight_dual_scale')]}.mul_scale"
        for n in merged
        if n.endswith(".weight_dual_scale")
        and f"{n[: -len('.weight_dual_scale')]}.mul_scale" not in expected_names
    }
    assert identity, "the fixture has DualScale layers without Smooth"
    for name in identity:
        assert merged[name].dtype == torch.float32 and torch.equal(
            merged[name], torch.ones_like(merged[name])
        )
    assert set(merged) == expected_names | identity
    summary = next(t for t in report.transformers if t.name == folder)
    assert summary.tensors == len(merged) and summary.tensors_from_original == 0


@pytest.mark.parametrize("folder", list(EXPERTS))
def test_config_and_ignored_layers(merged_dual, dual_export, folder):
    out, report = merged_dual
    config = json.loads((out / folder / "config.json").read_text())
    original = json.loads((dual_export.original / folder / "config.json").read_text())
    assert config.pop("quantization_config") == {
        "quant_method": "mxfp4_dualscale",
        "is_checkpoint_serialized": True,
        "ignored_layers": EXPECTED_IGNORED["dual"][folder],
    }
    assert config == original
    summary = next(t for t in report.transformers if t.name == folder)
    assert summary.ignored_layers == EXPECTED_IGNORED["dual"][folder]
    assert summary.quant_method == "mxfp4_dualscale" and summary.require_smooth_scale is None
    assert summary.smooth_layers == sum(len(group) for group in dual_export.specs[folder].smooth)


@pytest.mark.parametrize("folder", list(EXPERTS))
def test_dequantized_weights_equal_what_msmodelslim_quantized(merged_dual, dual_export, folder):
    out, _ = merged_dual
    merged = _load_dir(out / folder)
    state = dual_export.states[folder]
    names = _diffusers_names(state)
    references = dual_export.references[folder]
    assert len(references) >= 18
    for original_layer, ref in references.items():
        layer = names[f"{original_layer}.weight"][: -len(".weight")]
        assert merged[f"{layer}.weight"].dtype == torch.uint8
        values = _decode(
            merged[f"{layer}.weight"], merged[f"{layer}.weight_scale"], merged[f"{layer}.weight_dual_scale"]
        )
        assert torch.equal(values, ref.values), layer
        effective = values
        if ref.mul_scale is not None:
            assert torch.equal(merged[f"{layer}.mul_scale"].double(), ref.mul_scale)
            effective = values * ref.mul_scale[None, :]
        else:
            assert torch.equal(merged[f"{layer}.mul_scale"], torch.ones(values.shape[1]))  # identity Smooth
        # and it is the layer of the same name in the BF16 original: MXFP4 error (larger where Smooth
        # spreads the columns), not another matrix (relative error ~1.4 between two random layers)
        original = state[f"{layer}.weight"].double()
        assert (effective - original).norm() / original.norm() < 0.4, layer


def test_remapped_description(merged_dual, dual_export):
    out, _ = merged_dual
    description = json.loads((out / "transformer" / "quant_model_description.json").read_text())
    labels = _export_labels(dual_export.quant / "high_noise_model")
    names = _diffusers_names(dual_export.states["transformer"])
    assert description.pop("model_quant_type") == "W4A4_MXFP4_DUALSCALE"
    assert description == {_expected_name(k, names): v for k, v in labels.items()}
    assert description["blocks.1.attn1.to_q.weight_dual_scale"] == "W4A4_MXFP4_DUALSCALE"
    assert description["blocks.1.attn1.to_q.mul_scale"] == "FLOAT"
    assert description["blocks.0.attn1.to_q.weight"] == "FLOAT"


def test_other_components_are_copied_byte_for_byte(merged_dual, dual_export):
    out, report = merged_dual
    original = dual_export.original
    files = sorted(p.relative_to(original) for p in original.rglob("*") if p.is_file())
    copied = [f for f in files if f.parts[0] not in ("transformer", "transformer_2")]
    assert len(copied) == report.copied_files == 9
    for rel in copied:
        assert (out / rel).read_bytes() == (original / rel).read_bytes(), rel
    assert sorted(p.name for p in (out / "transformer").iterdir()) == [
        "config.json",
        "diffusion_pytorch_model.safetensors",
        "quant_model_description.json",
    ]


@pytest.mark.parametrize("folder", list(EXPERTS))
def test_single_scale_numeric_layout_and_shards(merged_single_numeric, single_export, folder):
    out, report = merged_single_numeric
    assert report.model_type == "Wan2.2-T2V-A14B"  # from model_index.json
    index = json.loads((out / folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 3
    for shard in shard_files:
        assert (out / folder / shard).stat().st_size <= 2_000_000 or len(
            load_file(str(out / folder / shard))
        ) == 1
    merged = _load_dir(out / folder)
    assert set(index["weight_map"]) == set(merged)
    exported = _load_dir(single_export.quant / EXPERTS[folder])
    state = single_export.states[folder]
    names = _diffusers_names(state)
    for original_layer, ref in single_export.references[folder].items():
        layer = names[f"{original_layer}.weight"][: -len(".weight")]
        weight = merged[f"{layer}.weight"]
        assert weight.dtype == torch.bfloat16 and weight.shape == state[f"{layer}.weight"].shape
        packed_name = (
            f"{original_layer}.linear.weight" if ref.mul_scale is not None else f"{original_layer}.weight"
        )
        codes = exported[packed_name]
        expected = E2M1[torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(weight.shape).long()]
        assert torch.equal(weight.double(), expected)
        assert torch.equal(torch.signbit(weight), torch.signbit(expected))  # -0 survives
        assert f"{layer}.weight_dual_scale" not in merged
        scaled = weight.double() * torch.exp2(
            merged[f"{layer}.weight_scale"].double() - 127
        ).repeat_interleave(32, 1)
        assert torch.equal(scaled, ref.values)
    config = json.loads((out / folder / "config.json").read_text())["quantization_config"]
    assert config == {
        "quant_method": "mxfp4",
        "is_checkpoint_mxfp4_serialized": True,
        "ignored_layers": EXPECTED_IGNORED["single"][folder],
        "require_smooth_scale": folder == "transformer",  # Smooth on every quantized layer there only
    }
    summary = next(t for t in report.transformers if t.name == folder)
    assert summary.saver == "ascendv1" and summary.description == "quant_model_description.json"


def test_dry_run_writes_nothing_and_reports_the_same(tmp_path, dual_export, merged_dual):
    _, real = merged_dual
    out = tmp_path / "out"
    report = merge("Wan2.2-T2V-A14B", dual_export.original, dual_export.quant, out, dry_run=True)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert report.dry_run
    for dry, done in zip(report.transformers, real.transformers):
        assert (dry.layers_quantized, dry.layers_bf16, dry.ignored_layers, dry.tensors) == (
            done.layers_quantized,
            done.layers_bf16,
            done.ignored_layers,
            done.tensors,
        )


@pytest.fixture(scope="session")
def ti2v(tmp_path_factory, dual_export):
    """A one-transformer pipeline (TI2V-5B layout) and an export at the root of the quant path."""
    root = tmp_path_factory.mktemp("ti2v")
    original = root / "orig"
    shutil.copytree(dual_export.original, original, ignore=shutil.ignore_patterns("transformer_2"))
    index = json.loads((original / "model_index.json").read_text())
    index["transformer_2"] = [None, None]
    index["expand_timesteps"] = True  # TI2V-5B's; a one-transformer WanPipeline without it is Wan2.1
    (original / "model_index.json").write_text(json.dumps(index))
    quant = root / "quant"
    shutil.copytree(dual_export.quant / "high_noise_model", quant)
    return original, quant


@pytest.mark.parametrize("model_type", ["Wan2.2-TI2V-5B", "auto"])
def test_single_transformer_model(tmp_path, ti2v, merged_dual, model_type):
    original, quant = ti2v
    out = tmp_path / "out"
    report = merge(model_type, original, quant, out)
    assert report.model_type == "Wan2.2-TI2V-5B"
    assert not (out / "transformer_2").exists()
    dual_out, _ = merged_dual
    for name in ("diffusion_pytorch_model.safetensors", "config.json", "quant_model_description.json"):
        assert (out / "transformer" / name).read_bytes() == (dual_out / "transformer" / name).read_bytes()


def test_auto_detects_i2v_and_rejects_unknown_pipelines(tmp_path, dual_export):
    original = tmp_path / "orig"
    shutil.copytree(dual_export.original, original)
    index = json.loads((original / "model_index.json").read_text())
    index["_class_name"] = "WanImageToVideoPipeline"
    (original / "model_index.json").write_text(json.dumps(index))
    report = merge("auto", original, dual_export.quant, tmp_path / "out", dry_run=True)
    assert report.model_type == "Wan2.2-I2V-A14B"
    index["_class_name"] = "SanaPipeline"
    (original / "model_index.json").write_text(json.dumps(index))
    supported = "FluxPipeline, QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline, "
    supported += "WanImageToVideoPipeline, WanPipeline"
    with pytest.raises(
        CheckpointError, match=rf"pipeline class 'SanaPipeline' is not one the merge supports \({supported}\)"
    ):
        merge("auto", original, dual_export.quant, tmp_path / "out", dry_run=True)
    with pytest.raises(
        CheckpointError, match=r"lists transformers \['transformer', 'transformer_2'\], but Wan2.2-TI2V-5B"
    ):
        merge("Wan2.2-TI2V-5B", original, dual_export.quant, tmp_path / "out", dry_run=True)


def test_cli_json_report(tmp_path, dual_export, capsys):
    out = tmp_path / "out"
    argv = ["merge", "--model-type", "auto", "--original-model", str(dual_export.original)]
    argv += ["--quant-path", str(dual_export.quant), "--output-path", str(out), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["model_type"] == "Wan2.2-T2V-A14B" and not report["dry_run"]
    assert [t["ignored_layers"] for t in report["transformers"]] == [
        EXPECTED_IGNORED["dual"]["transformer"],
        EXPECTED_IGNORED["dual"]["transformer_2"],
    ]
    assert (out / "transformer_2" / "config.json").is_file()
    assert main(argv) == 2  # the output now exists
    error = json.loads(capsys.readouterr().out)
    assert error == {"ok": False, "error": f"output path {out} exists; pass --overwrite to replace it"}


def test_cli_summary_and_errors(tmp_path, dual_export, capsys):
    argv = ["merge", "--model-type", "Wan2.2-T2V-A14B", "--original-model", str(dual_export.original)]
    argv += ["--quant-path", str(dual_export.quant), "--output-path", str(tmp_path / "out"), "--dry-run"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "dry run, nothing written: Wan2.2-T2V-A14B" in captured.out
    assert re.search(
        r"transformer +<- high_noise_model: mxfp4_dualscale, 18 layers quantized, 18 kept BF16", captured.out
    )
    assert not (tmp_path / "out").exists()
    assert main([*argv[:-1], "--quant-path", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and err.startswith("error: quantized export directory")
        and "Traceback" not in err
    )
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--max-shard-size", "lots"])
    assert exc.value.code == 2


def test_tools_wrapper_has_the_same_interface(tmp_path, dual_export):
    cmd = [
        sys.executable,
        str(REPO / "tools" / "merge_mxfp4_dualscale_checkpoint.py"),
        "--model-type",
        "auto",
    ]
    cmd += ["--original-model", str(dual_export.original), "--quant-path", str(dual_export.quant)]
    cmd += ["--output-path", str(tmp_path / "out"), "--dry-run", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["dry_run"] is True
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="session")
def nonblock_export(tmp_path_factory, dual_export, ti2v):
    """msModelSlim quantizing every Linear but block 0 (embedders and head included), one transformer."""
    quant = tmp_path_factory.mktemp("nonblock") / "quant"
    spec = ExpertSpec("dual", "mindie", exclude=["*blocks.0.*"])
    quantize_expert(dual_export.states["transformer"], quant, spec)
    return ti2v[0], quant


def test_quantized_non_block_linears(tmp_path, nonblock_export, dual_export):
    original, quant = nonblock_export
    with pytest.raises(
        CheckpointError,
        match=r"layer condition_embedder\.text_embedder\.linear_1 \(export text_embedding\.0\): is quantized, but vLLM-Omni runs this Linear in BF16",
    ):
        merge("auto", original, quant, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    report = merge("auto", original, quant, tmp_path / "out", non_block_quantized="original")
    (summary,) = report.transformers
    assert summary.ignored_layers == [*_whole_block(0), *NON_BLOCK]
    assert len(summary.warnings) == len(NON_BLOCK)
    merged = _load_dir(tmp_path / "out" / "transformer")
    state = dual_export.states["transformer"]
    for layer in NON_BLOCK:
        for leaf in ("weight", "bias"):
            assert torch.equal(
                merged[f"{layer}.{leaf}"].view(torch.uint8), state[f"{layer}.{leaf}"].view(torch.uint8)
            )
        assert f"{layer}.weight_scale" not in merged
    assert merged["blocks.1.ffn.net.2.weight"].dtype == torch.uint8


def test_smooth_on_a_bf16_layer_is_an_error(tmp_path, dual_export, ti2v):
    """msModelSlim smooths a Linear that is then excluded from quantization: its weight is pre-scaled."""
    quant = tmp_path / "quant"
    spec = ExpertSpec(
        "dual", "mindie", exclude=["*blocks.0.*", "head.*", "*_embedding.*", "time_projection.*"]
    )
    spec.smooth = [["blocks.0.ffn.0"]]
    quantize_expert(dual_export.states["transformer"], quant, spec)
    assert "blocks.0.ffn.0.div.mul_scale" in json.loads(
        next(quant.glob("quant_model_description*.json")).read_text()
    )
    with pytest.raises(
        CheckpointError,
        match=r"layer blocks\.0\.ffn\.net\.0\.proj \(export blocks\.0\.ffn\.0\): kept in BF16 but carries a Smooth scale",
    ):
        merge("auto", ti2v[0], quant, tmp_path / "out")


def test_sharded_original_gives_the_same_output(tmp_path, dual_export, merged_dual):
    from diffusers import WanTransformer3DModel

    original = tmp_path / "orig"
    shutil.copytree(dual_export.original, original)
    for folder in EXPERTS:
        model = WanTransformer3DModel.from_pretrained(
            dual_export.original / folder, torch_dtype=torch.bfloat16
        ).to(torch.bfloat16)  # from_pretrained keeps the norms in float32; the original has them in BF16
        shutil.rmtree(original / folder)
        model.save_pretrained(original / folder, max_shard_size="2MB")
        assert len(list((original / folder).glob("diffusion_pytorch_model-*-of-*.safetensors"))) > 3
    merge("auto", original, dual_export.quant, tmp_path / "out")
    dual_out, _ = merged_dual
    for folder in EXPERTS:
        name = "diffusion_pytorch_model.safetensors"
        assert (tmp_path / "out" / folder / name).read_bytes() == (dual_out / folder / name).read_bytes()


def test_written_configs_parse_with_the_runtime_config(merged_dual, merged_single_numeric):
    """The contract with vllm_omni_mxfp4.config: what the merge writes, the runtime config accepts."""
    from vllm_omni_mxfp4.config import Mxfp4Config, Mxfp4DualScaleConfig, parse_quantization

    for (out, _), kind, folder in (
        (merged_dual, "dual", "transformer"),
        (merged_single_numeric, "single", "transformer"),
        (merged_single_numeric, "single", "transformer_2"),
    ):
        written = json.loads((out / folder / "config.json").read_text())["quantization_config"]
        config = parse_quantization(written)
        assert isinstance(config, Mxfp4DualScaleConfig if kind == "dual" else Mxfp4Config)
        assert list(config.ignored_layers) == sorted(EXPECTED_IGNORED[kind][folder])
        if kind == "single":
            assert config.is_checkpoint_mxfp4_serialized and config.require_smooth_scale == (
                folder == "transformer"
            )
        else:
            assert config.is_checkpoint_serialized


def _bytes_under(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def test_bytes_out_count_every_written_file_subdirectories_included(tmp_path, dual_export):
    """A transformer directory with a subdirectory (a model card's images, say) is copied whole, and
    ``bytes_out`` counts what was written there too: the merge's and the convert's reports count
    bytes the same way (they share one writer)."""
    original = tmp_path / "original"
    shutil.copytree(dual_export.original, original)
    (original / "transformer" / "assets").mkdir()
    (original / "transformer" / "assets" / "card.bin").write_bytes(b"\x01" * 4096)
    report = merge("Wan2.2-T2V-A14B", original, dual_export.quant, tmp_path / "out")
    written = {t.name: t for t in report.transformers}
    for folder in ("transformer", "transformer_2"):
        assert written[folder].bytes_out == _bytes_under(tmp_path / "out" / folder)
    assert (tmp_path / "out" / "transformer" / "assets" / "card.bin").read_bytes() == b"\x01" * 4096
