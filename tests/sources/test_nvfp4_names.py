"""BFL -> diffusers FLUX.2 names against diffusers' own conversion, and a BFL Comfy file converted.

The reference is ``convert_flux2_transformer_checkpoint_to_diffusers`` from the installed diffusers:
it renames a BFL state dict (every kind of key FLUX.2 has) and splits or swaps its rows; our table
must give the same names and the same rows. The Comfy file is made by comfy-kitchen itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.nvfp4.producers.comfy import comfy_layer
from vllm_omni_mxfp4.convert import convert
from vllm_omni_mxfp4.convert.tensors import rows_of
from vllm_omni_mxfp4.formats.requant import requantize_nvfp4
from vllm_omni_mxfp4.sources.nvfp4 import SourceError, detect_nvfp4, load_nvfp4_weight
from vllm_omni_mxfp4.sources.nvfp4.names import (
    bfl_module,
    bfl_param,
    flux2_quantizable,
    flux2_runtime_name,
    is_bfl,
)

ROOT_KEYS = (
    "img_in.weight",
    "txt_in.weight",
    "time_in.in_layer.weight",
    "time_in.out_layer.weight",
    "guidance_in.in_layer.weight",
    "guidance_in.out_layer.weight",
    "double_stream_modulation_img.lin.weight",
    "double_stream_modulation_txt.lin.weight",
    "single_stream_modulation.lin.weight",
    "final_layer.linear.weight",
    "final_layer.adaLN_modulation.1.weight",
)
DOUBLE_KEYS = (
    "img_attn.qkv.weight",
    "img_attn.norm.query_norm.scale",
    "img_attn.norm.key_norm.scale",
    "img_attn.proj.weight",
    "img_mlp.0.weight",
    "img_mlp.2.weight",
    "txt_attn.qkv.weight",
    "txt_attn.norm.query_norm.scale",
    "txt_attn.norm.key_norm.scale",
    "txt_attn.proj.weight",
    "txt_mlp.0.weight",
    "txt_mlp.2.weight",
)
SINGLE_KEYS = ("linear1.weight", "linear2.weight", "norm.query_norm.scale", "norm.key_norm.scale")


def bfl_state_dict() -> dict[str, torch.Tensor]:
    """Every kind of BFL FLUX.2 key, blocks 0 and 10 (``10`` must not be read as ``1``), with
    distinct values so that a wrong split or swap shows."""
    keys = list(ROOT_KEYS)
    for block in (0, 10):
        keys += [f"double_blocks.{block}.{k}" for k in DOUBLE_KEYS]
        keys += [f"single_blocks.{block}.{k}" for k in SINGLE_KEYS]
    gen = torch.Generator().manual_seed(0)
    return {
        k: torch.randn(12, 4, generator=gen) if not k.endswith(".scale") else torch.randn(4, generator=gen)
        for k in keys
    }


def ours(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        module, _, param = key.rpartition(".")
        for part in bfl_module(module):
            out[f"{part.name}.{bfl_param(param)}"] = rows_of(value, part)
    return out


def test_the_table_gives_diffusers_own_names_and_rows() -> None:
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    state = bfl_state_dict()
    expected = convert_flux2_transformer_checkpoint_to_diffusers({k: v.clone() for k, v in state.items()})
    got = ours(state)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_comfy_prefix_is_dropped_and_bfl_names_are_recognised() -> None:
    prefixed = "model.diffusion_model.double_blocks.3.img_attn.qkv"
    assert [p.name for p in bfl_module(prefixed)] == [
        "transformer_blocks.3.attn.to_q",
        "transformer_blocks.3.attn.to_k",
        "transformer_blocks.3.attn.to_v",
    ]
    assert is_bfl([f"{prefixed}.weight"]) and not is_bfl(["transformer_blocks.3.attn.to_q.weight"])


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("double_blocks.0.img_mod.lin", "unknown BFL FLUX.2 double_blocks module 'img_mod.lin'"),
        ("single_blocks.2.modulation.lin", "unknown BFL FLUX.2 single_blocks module 'modulation.lin'"),
        ("vector_in.in_layer", "unknown BFL FLUX.2 module"),
    ],
)
def test_unknown_names_are_refused_naming_them(name: str, fragment: str) -> None:
    with pytest.raises(SourceError) as info:
        bfl_module(name)
    assert str(info.value).startswith(f"{name}: ") and fragment in str(info.value)


def test_runtime_names_follow_vllm_omni_flux2_fusions() -> None:
    assert flux2_runtime_name("transformer_blocks.1.attn.to_k") == "transformer_blocks.1.attn.to_qkv"
    assert (
        flux2_runtime_name("transformer_blocks.1.attn.add_v_proj") == "transformer_blocks.1.attn.add_kv_proj"
    )
    assert flux2_runtime_name("transformer_blocks.1.attn.to_out.0") == "transformer_blocks.1.attn.to_out.0"
    assert flux2_runtime_name("single_transformer_blocks.0.attn.to_qkv_mlp_proj") == (
        "single_transformer_blocks.0.attn.to_qkv_mlp_proj"
    )
    assert flux2_quantizable("single_transformer_blocks.0.attn.to_out")
    assert not flux2_quantizable("transformer_blocks.0.attn.norm_q")
    assert not flux2_quantizable("proj_out") and not flux2_quantizable("norm_out.linear")


def flux2_comfy_file(directory: Path) -> Path:
    """A one-double-block, one-single-block BFL FLUX.2 transformer: block Linears NVFP4 by
    comfy-kitchen except ``img_mlp.0`` (kept BF16), everything else BF16, with a diffusers config."""
    gen = torch.Generator().manual_seed(1)

    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) * 0.05).bfloat16()

    tensors: dict[str, torch.Tensor] = {}
    for name in ("double_blocks.0.img_attn.qkv", "double_blocks.0.txt_attn.qkv", "single_blocks.0.linear1"):
        tensors |= comfy_layer(name, w(192, 64))
    for name in ("double_blocks.0.img_attn.proj", "double_blocks.0.txt_attn.proj", "single_blocks.0.linear2"):
        tensors |= comfy_layer(name, w(64, 64))
    tensors["double_blocks.0.img_mlp.0.weight"] = w(128, 64)
    for key in ROOT_KEYS:
        tensors[key] = w(128 if "adaLN" in key else 64, 64)
    tensors["double_blocks.0.img_attn.norm.query_norm.scale"] = w(1, 16).reshape(16)
    directory.mkdir()
    save_file(tensors, str(directory / "flux2-nvfp4.safetensors"))
    (directory / "config.json").write_text(
        json.dumps({"_class_name": "Flux2Transformer2DModel", "num_layers": 1})
    )
    return directory


def test_a_bfl_comfy_file_converts_to_diffusers_names(tmp_path: Path, monkeypatch) -> None:
    from vllm_omni_mxfp4.convert import tensors as convert_tensors

    source = flux2_comfy_file(tmp_path / "in")
    calls = []
    real = convert_tensors.requantize_nvfp4
    monkeypatch.setattr(
        convert_tensors, "requantize_nvfp4", lambda w, rule, **kw: calls.append(w.name) or real(w, rule, **kw)
    )
    report = convert(source, tmp_path / "out", progress=False)
    assert sorted(calls) == sorted(set(calls)) and len(calls) == 6  # each layer once, its Q/K/V parts from it
    out = load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors")
    stored = load_file(source / "flux2-nvfp4.safetensors")
    qkv = detect_nvfp4(source).layers["double_blocks.0.img_attn.qkv"]
    expected = requantize_nvfp4(load_nvfp4_weight(qkv, stored.__getitem__), "mse")
    for i, name in enumerate(("to_q", "to_k", "to_v")):
        rows = slice(64 * i, 64 * (i + 1))
        assert torch.equal(out[f"transformer_blocks.0.attn.{name}.weight"], expected.data[rows]), name
        assert torch.equal(out[f"transformer_blocks.0.attn.{name}.weight_scale"], expected.scale[rows]), name
    ada = stored["final_layer.adaLN_modulation.1.weight"]
    assert torch.equal(out["norm_out.linear.weight"], torch.cat([ada[64:], ada[:64]]))
    assert torch.equal(
        out["transformer_blocks.0.attn.norm_q.weight"],
        stored["double_blocks.0.img_attn.norm.query_norm.scale"],
    )
    assert torch.equal(
        out["transformer_blocks.0.ff.linear_in.weight"], stored["double_blocks.0.img_mlp.0.weight"]
    )
    assert out["single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"].shape == (192, 32)
    assert not [n for n in out if "comfy_quant" in n or n.endswith("weight_scale_2")]
    component = report.components[0]
    assert component.producer == "comfy"
    assert component.ignored_layers == ["transformer_blocks.0.ff.linear_in"]
    assert {layer.name for layer in component.layers if layer.action == "mxfp4"} == {
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.attn.to_k",
        "transformer_blocks.0.attn.to_v",
        "transformer_blocks.0.attn.add_q_proj",
        "transformer_blocks.0.attn.add_k_proj",
        "transformer_blocks.0.attn.add_v_proj",
        "transformer_blocks.0.attn.to_out.0",
        "transformer_blocks.0.attn.to_add_out",
        "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
        "single_transformer_blocks.0.attn.to_out",
    }
