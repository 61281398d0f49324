"""msModelSlim's shipped Wan2.2 recipes (w4a4f4, w4a4f8), run unedited on a tiny 6-block model on the
CPU, merged: W8A8 MXFP8 blocks kept (``mxfp8_layers``) or taken from BF16, online Q/K rotations
recorded and left out, FA3 records reported per attention, and every element we cannot serve refused
by name with nothing written (issue #15)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from vllm_omni_mxfp4.checkpoint import CheckpointError, merge
from vllm_omni_mxfp4.cli import main
from vllm_omni_mxfp4.config import parse_quantization

from ..formats.reference import CODE_VALUES
from .conftest import EXPERTS
from .edits import edit, relabel, replace
from .producer import original_name

E2M1 = torch.tensor(CODE_VALUES, dtype=torch.float64)
BLOCKS = 6
MXFP8_BLOCKS = range(5)  # the recipes' w8a8_include: blocks 0-4
# The runtime Linears of one Wan block (vLLM-Omni names, written by hand).
RUNTIME = ("attn1.to_out", "attn1.to_qkv", "attn2.to_k", "attn2.to_out", "attn2.to_q", "attn2.to_v")
RUNTIME += ("ffn.net_0.proj", "ffn.net_2")
NON_BLOCK = [
    "condition_embedder.text_embedder.linear_1",
    "condition_embedder.text_embedder.linear_2",
    "condition_embedder.time_embedder.linear_1",
    "condition_embedder.time_embedder.linear_2",
    "condition_embedder.time_proj",
    "proj_out",
]
# msModelSlim's FA3 dtype per self-attention, from the recipe YAMLs (f8: block 0 excluded).
FA3 = {
    "w4a4f4": {f"blocks.{i}.attn1": "FP8_DYNAMIC" if i == 0 else "MXFP4_DYNAMIC" for i in range(BLOCKS)},
    "w4a4f8": {f"blocks.{i}.attn1": "FP8_DYNAMIC" for i in range(1, BLOCKS)},
}
ROTATED = [f"blocks.{i}.attn1" for i in range(BLOCKS)]
Q5 = "blocks.5.self_attn.q"


def _block_linears(blocks) -> list[str]:
    return [f"blocks.{i}.{name}" for i in blocks for name in RUNTIME]


def _merged(directory, folder):
    tensors = {}
    for path in sorted((directory / folder).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors, json.loads((directory / folder / "config.json").read_text())


def _e4m3(weight: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 codes to float64, from the bit fields (written independently of the package)."""
    code = weight.view(torch.uint8).long()
    exponent, mantissa = (code >> 3) & 0xF, (code & 7).double()
    magnitude = torch.where(
        exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * torch.exp2(exponent.double() - 7)
    )
    return torch.where(code >= 128, -magnitude, magnitude)


def _decode(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if weight.dtype == torch.float8_e4m3fn:
        values = _e4m3(weight)
    else:
        codes = torch.stack((weight & 0xF, weight >> 4), dim=-1).reshape(weight.shape[0], -1).long()
        values = E2M1[codes]
    return values * torch.exp2(scale.double() - 127).repeat_interleave(32, dim=1)[:, : values.shape[1]]


def _msmodelslim_values(module: torch.nn.Module) -> torch.Tensor:
    """msModelSlim's own dequantized weight of one of its fake-quant Linears (element values times
    2^exponent per 32 along K)."""
    exponent = module.weight_scale.detach().double().reshape(module.weight.shape[0], -1)
    k = module.weight.shape[1]
    return module.weight.detach().double() * torch.exp2(exponent.repeat_interleave(32, dim=1)[:, :k])


@pytest.mark.parametrize("recipe", ["w4a4f4", "w4a4f8"])
def test_merged_config_lists_mxfp8_layers_rotation_and_report_fa3(merged_recipes, recipe):
    out, report = merged_recipes[recipe]
    for t in report.transformers:
        _, config = _merged(out, t.name)
        quant = config["quantization_config"]
        assert quant["quant_method"] == "mxfp4" and quant["is_checkpoint_mxfp4_serialized"] is True
        assert quant["mxfp8_layers"] == _block_linears(MXFP8_BLOCKS)
        assert quant["ignored_layers"] == NON_BLOCK
        assert quant["online_rotation"]["layers"] == ROTATED
        assert quant["online_rotation"]["applied"] is False
        assert t.fa3_attention == FA3[recipe]
        assert t.layers_quantized == 10 * BLOCKS and t.mxfp8_to_bf16 == []
        parsed = parse_quantization(quant)
        assert parsed.mxfp8_layers == tuple(_block_linears(MXFP8_BLOCKS))
        assert parsed.online_rotation == quant["online_rotation"]
        assert any("attention stays BF16" in w for w in t.warnings)


@pytest.mark.parametrize("folder", list(EXPERTS))
def test_every_quantized_weight_decodes_to_msmodelslims(merged_recipes, w4a4f4_export, folder):
    tensors, _ = _merged(merged_recipes["w4a4f4"][0], folder)
    linears = w4a4f4_export.linears[folder]
    names = {original_name(name): name for name in w4a4f4_export.states[folder]}
    assert len(linears) == 10 * BLOCKS  # q, k, v, o of both attentions, ffn.0, ffn.2
    for layer, module in linears.items():
        diffusers = names[f"{layer}.weight"][: -len(".weight")]
        weight, scale = tensors[f"{diffusers}.weight"], tensors[f"{diffusers}.weight_scale"]
        block = int(layer.split(".")[1])
        assert weight.dtype == (torch.float8_e4m3fn if block in MXFP8_BLOCKS else torch.uint8), layer
        assert torch.equal(_decode(weight, scale), _msmodelslim_values(module)), layer
        assert torch.equal(tensors[f"{diffusers}.bias"].float(), module.bias.float()), layer
    assert not [name for name in tensors if name.endswith("_rot")]


def test_w4a4f8_differs_from_w4a4f4_only_in_fa3(merged_recipes):
    for folder in EXPERTS:
        f4, _ = _merged(merged_recipes["w4a4f4"][0], folder)
        f8, _ = _merged(merged_recipes["w4a4f8"][0], folder)
        assert f4.keys() == f8.keys()
        assert all(torch.equal(f4[k].view(torch.uint8), f8[k].view(torch.uint8)) for k in f4)


@pytest.mark.parametrize("folder", list(EXPERTS))
def test_mxfp8_layers_bf16_takes_the_original(merged_recipes, w4a4f4_export, folder):
    out, report = merged_recipes["w4a4f4-bf16"]
    tensors, config = _merged(out, folder)
    quant = config["quantization_config"]
    assert "mxfp8_layers" not in quant
    assert quant["ignored_layers"] == [*_block_linears(MXFP8_BLOCKS), *NON_BLOCK]
    (t,) = [t for t in report.transformers if t.name == folder]
    assert t.mxfp8_to_bf16 == _block_linears(MXFP8_BLOCKS) and t.layers_quantized == 10
    original = w4a4f4_export.states[folder]
    for name, value in original.items():
        if name.startswith(tuple(f"blocks.{i}." for i in MXFP8_BLOCKS)):
            assert torch.equal(tensors[name], value), name
    assert tensors["blocks.5.attn1.to_q.weight"].dtype == torch.uint8


def test_cli_summary_names_fa3_and_mxfp8(tmp_path, w4a4f4_export, capsys):
    argv = ["merge", "--model-type", "auto", "--original-model", str(w4a4f4_export.original)]
    argv += ["--quant-path", str(w4a4f4_export.quant), "--output-path", str(tmp_path / "out")]
    assert main([*argv, "--mxfp8-layers", "bf16", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "W8A8 MXFP8: 0 layers kept (mxfp8_layers), 40 taken from the BF16 original" in text
    assert "attention blocks.0.attn1: FA3 FP8_DYNAMIC in the export, runs BF16" in text
    assert "online Q/K rotation on 6 attention layer(s) not applied" in text
    assert not (tmp_path / "out").exists()


@pytest.fixture
def recipe_copy(tmp_path, w4a4f4_export):
    """A writable copy of the w4a4f4 pipeline + export, for building bad inputs from a valid one."""
    shutil.copytree(w4a4f4_export.original, tmp_path / "orig")
    shutil.copytree(w4a4f4_export.quant, tmp_path / "quant")
    return tmp_path / "orig", tmp_path / "quant"


def _refused(recipe_copy, tmp_path, message, mutate, **options):
    original, quant = recipe_copy
    edit(quant / "high_noise_model", mutate)
    with pytest.raises(CheckpointError, match=message) as exc:
        merge("auto", original, quant, tmp_path / "out", **options)
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "out").exists()


def _add(name: str, source: str, label: str = "FLOAT"):
    def mutate(tensors, entries):
        tensors[name] = tensors[source].clone()
        entries[name] = label

    return mutate


def _rotate_q_weight(tensors, entries):
    """blocks.5's Q weight no longer the original's, as after an offline rotation: its rows rolled by
    one (valid MXFP4 codes, another matrix)."""
    weight = tensors[f"{Q5}.weight"]
    tensors[f"{Q5}.weight"] = weight.roll(1, dims=0).contiguous()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            _add("blocks.2.self_attn.v_rot", "blocks.2.self_attn.q_rot"),
            r"rotation record 'blocks\.2\.self_attn\.v_rot' is not a q_rot/k_rot of an attention",
        ),
        (
            _add("blocks.2.ffn.0.rot", "blocks.2.self_attn.q_rot"),
            r"rotation record 'blocks\.2\.ffn\.0\.rot' is not a q_rot/k_rot of an attention",
        ),
        (
            replace("blocks.3.self_attn.k_rot", lambda r: r.flip(0)),
            r"blocks\.3\.self_attn\.q_rot and k_rot differ",
        ),
        (
            replace("blocks.1.self_attn.q_rot", lambda r: r * 2),
            r"rotation record 'blocks\.1\.self_attn\.q_rot' is not orthogonal",
        ),
        (
            _rotate_q_weight,
            r"the stored weight of blocks\.5\.self_attn\.q differs from the original's \(cosine .*\) beyond "
            r"quantization error: it was rotated offline",
        ),
        (
            relabel("fa_quant_type", "FAQuant"),
            r"fa_quant_type 'FAQuant' records FA3 per_head attention scales .*fa3_quant",
        ),
        (
            relabel("blocks.5.ffn.0.weight_scale", "W8A8_DYNAMIC"),
            r"tensor 'blocks\.5\.ffn\.0\.weight_scale' has unsupported description label 'W8A8_DYNAMIC'; "
            r".*a recipe step 'linear_quant' writes the label of its qconfig",
        ),
        (
            relabel("model_quant_type", "W4A4_MXFP4_DUALSCALE"),
            r"model_quant_type 'W4A4_MXFP4_DUALSCALE' disagrees with the tensor labels \(W4A4_MXFP4, W8A8_MXFP8\)",
        ),
    ],
    ids=[
        "v_rot",
        "linear_rot",
        "q_ne_k",
        "not_orthogonal",
        "offline_rotation",
        "fa3_per_head",
        "label",
        "mqt",
    ],
)
def test_unsupported_recipe_elements_are_refused(recipe_copy, tmp_path, mutate, message):
    _refused(recipe_copy, tmp_path, message, mutate)


def test_qkv_in_two_formats_is_refused(recipe_copy, tmp_path):
    """blocks.5's Q stored as MXFP8 (blocks.4's Q tensors, same shape) next to MXFP4 K and V."""

    def mutate(tensors, entries):
        for leaf in ("weight", "weight_scale"):
            tensors[f"{Q5}.{leaf}"] = tensors[f"blocks.4.self_attn.q.{leaf}"].clone()
            entries[f"{Q5}.{leaf}"] = "W8A8_MXFP8"

    message = (
        r"fused blocks\.5\.attn1\.to_qkv \(export blocks\.5\.self_attn\): to_q/to_k/to_v are stored in "
        r"different formats \(to_q W8A8_MXFP8, to_k W4A4_MXFP4, to_v W4A4_MXFP4\)"
    )
    _refused(recipe_copy, tmp_path, message, mutate)
