"""Detection of NVFP4 checkpoints in each producer's real forms, and every refusal.

Valid inputs are the producers' own: ModelOpt's exports (fixtures it wrote: flat config.json,
nested hf_quant_config.json, W4A16, post-processed with swizzled scales and header metadata),
compressed-tensors' config and packing, comfy-kitchen's layers with ``.comfy_quant`` markers.
Each refusal starts from one of them and changes one thing; the message must name the layer and
the reason.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.nvfp4.checkpoints import MODELOPT_FIXTURES, write_checkpoint
from tests.support.nvfp4.producers.comfy import comfy_layer, marker_tensor
from tests.support.nvfp4.producers.compressed import ct_config, ct_layer
from vllm_omni_mxfp4.formats.nvfp4 import dequantize_nvfp4
from vllm_omni_mxfp4.sources.nvfp4 import (
    SourceError,
    detect_nvfp4,
    load_mul_scale,
    load_nvfp4_weight,
    parse_quant_config,
    swap_nibbles,
)

FIXTURES = MODELOPT_FIXTURES
FFN = "blocks.0.ffn.net.0.proj"
TO_Q = "blocks.0.attn1.to_q"


def modelopt_tensors(export: str = "nvfp4") -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / export / "diffusion_pytorch_model.safetensors")


def modelopt_config(export: str = "nvfp4") -> dict:
    return json.loads((FIXTURES / export / "config.json").read_text())["quantization_config"]


def variant(tmp_path: Path, tensors=None, config=None, **kwargs) -> Path:
    """A ModelOpt flat export with some tensors or config keys replaced."""
    return write_checkpoint(
        tmp_path / "ckpt",
        tensors if tensors is not None else modelopt_tensors(),
        config if config is not None else modelopt_config(),
        **kwargs,
    )


def refused(path: Path, *fragments: str) -> None:
    with pytest.raises(SourceError) as info:
        detect_nvfp4(path)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


# ------------------------------------------------------------------------------- recognised


def test_modelopt_flat_export() -> None:
    checkpoint = detect_nvfp4(FIXTURES / "nvfp4")
    assert checkpoint.producer == "modelopt" and "config.json quantization_config" in checkpoint.origin
    tensors = modelopt_tensors()
    quantized = sorted(k.removesuffix(".weight_scale") for k in tensors if k.endswith(".weight_scale"))
    assert checkpoint.names("requantize") == quantized
    ffn = checkpoint.layers[FFN]
    assert (ffn.algo, ffn.nibble_order, ffn.scale_layout, ffn.shape) == (
        "NVFP4",
        "low_even",
        "linear",
        (128, 64),
    )
    assert ffn.tensors == {
        "weight": f"{FFN}.weight",
        "weight_scale": f"{FFN}.weight_scale",
        "global_scale": f"{FFN}.weight_scale_2",
        "bias": f"{FFN}.bias",
    }
    assert checkpoint.layers["proj_out"].reason == "excluded by ignore pattern 'proj_out'"
    assert checkpoint.layers["patch_embedding"].action == "keep"
    assert "requantize" in checkpoint.summary()


def test_modelopt_nested_hf_quant_config(tmp_path: Path) -> None:
    path = tmp_path / "nested"
    shutil.copytree(FIXTURES / "nvfp4", path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    checkpoint = detect_nvfp4(path)
    assert checkpoint.origin.endswith("hf_quant_config.json")
    assert checkpoint.names("requantize") == detect_nvfp4(FIXTURES / "nvfp4").names("requantize")
    assert checkpoint.layers["proj_out"].reason == "excluded by exclude_modules pattern 'proj_out'"


def test_modelopt_w4a16_export() -> None:
    checkpoint = detect_nvfp4(FIXTURES / "w4a16")
    assert {checkpoint.layers[n].algo for n in checkpoint.names("requantize")} == {"W4A16_NVFP4"}


def test_modelopt_post_processed_export_is_swizzled_everywhere(tmp_path: Path) -> None:
    """Single-file post-processing swizzles every layer; where a shape fits both layouts
    (128 rows, 4 scale columns) the checkpoint's unambiguous layers decide."""
    checkpoint = detect_nvfp4(FIXTURES / "swizzled")
    assert {checkpoint.layers[n].scale_layout for n in checkpoint.names("requantize")} == {"swizzled"}
    header_only = tmp_path / "header_only"
    header_only.mkdir()
    shutil.copy(FIXTURES / "swizzled" / "diffusion_pytorch_model.safetensors", header_only)
    again = detect_nvfp4(header_only)
    assert again.origin == "safetensors header"
    assert again.layers[FFN] == checkpoint.layers[FFN]


def test_sglang_swapped_nibbles_are_normalised(tmp_path: Path) -> None:
    tensors = modelopt_tensors()
    swapped = {k: swap_nibbles(v) if v.dtype == torch.uint8 else v for k, v in tensors.items()}
    config = modelopt_config() | {"swap_weight_nibbles": True, "checkpoint_weight_scale_layout": "linear"}
    checkpoint = detect_nvfp4(variant(tmp_path, swapped, config))
    layer = checkpoint.layers[FFN]
    assert layer.nibble_order == "high_even"
    original = detect_nvfp4(FIXTURES / "nvfp4").layers[FFN]
    assert torch.equal(
        dequantize_nvfp4(load_nvfp4_weight(layer, swapped.__getitem__)),
        dequantize_nvfp4(load_nvfp4_weight(original, tensors.__getitem__)),
    )


def mixed_nested(tmp_path: Path) -> tuple[Path, dict]:
    """ModelOpt's MIXED_PRECISION export with only its nested hf_quant_config.json (returned, to edit)."""
    path = tmp_path / "mixed"
    shutil.copytree(FIXTURES / "mixed", path)
    (path / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
    return path, json.loads((path / "hf_quant_config.json").read_text())


def test_modelopt_mixed_precision_with_an_fp8_layer(tmp_path: Path) -> None:
    """ModelOpt's own MIXED_PRECISION export (one FP8 Linear), flat and nested forms."""
    flat = detect_nvfp4(FIXTURES / "mixed")
    nested = detect_nvfp4(mixed_nested(tmp_path)[0])
    for checkpoint in (flat, nested):
        assert checkpoint.names("dequantize") == ["blocks.0.ffn.net.2"]
        assert (
            checkpoint.layers["blocks.0.ffn.net.2"].tensors["weight_scale"]
            == "blocks.0.ffn.net.2.weight_scale"
        )
        assert FFN in checkpoint.names("requantize") and "proj_out" in checkpoint.names("keep")
    assert flat.layers == nested.layers


def test_compressed_tensors_config_and_excludes(tmp_path: Path) -> None:
    tensors = {f"{TO_Q}.{k}": v for k, v in ct_layer(torch.randn(64, 64)).items()}
    tensors["proj_out.weight"] = torch.randn(16, 64).bfloat16()
    checkpoint = detect_nvfp4(write_checkpoint(tmp_path / "ct", tensors, ct_config(ignore=["re:proj_.*"])))
    assert checkpoint.layers[TO_Q].tensors["global_scale"] == f"{TO_Q}.weight_global_scale"
    assert checkpoint.layers["proj_out"].reason == "excluded by ignore pattern 're:proj_.*'"


def test_comfy_markers_and_an_fp8_marker(tmp_path: Path) -> None:
    pytest.importorskip("comfy_kitchen")
    tensors = comfy_layer(FFN, torch.randn(128, 64).bfloat16())
    tensors["blocks.0.ffn.net.2.weight"] = torch.randn(64, 128).to(torch.float8_e4m3fn)
    tensors["blocks.0.ffn.net.2.weight_scale"] = torch.tensor(0.01)
    tensors["blocks.0.ffn.net.2.comfy_quant"] = marker_tensor({"format": "float8_e4m3fn"})
    checkpoint = detect_nvfp4(write_checkpoint(tmp_path / "comfy", tensors))
    assert checkpoint.names("requantize") == [FFN]
    assert checkpoint.names("dequantize") == ["blocks.0.ffn.net.2"]
    assert checkpoint.layers[FFN].scale_layout == "swizzled"  # ambiguous shape: Comfy's convention decides


def test_checkpoints_without_nvfp4_are_not_claimed(tmp_path: Path) -> None:
    plain = write_checkpoint(tmp_path / "plain", {"proj_out.weight": torch.randn(4, 4)})
    assert detect_nvfp4(plain) is None
    assert parse_quant_config({"quant_method": "modelopt", "quant_algo": "FP8"}, "x") is None
    assert parse_quant_config({"quant_method": "mxfp4"}, "x") is None


# ---------------------------------------------------------------------------------- refused


def test_convrot_layers_are_refused(tmp_path: Path) -> None:
    pytest.importorskip("comfy_kitchen")
    for conf in ({"format": "convrot_w4a4"}, {"format": "nvfp4", "convrot": True}):
        tensors = comfy_layer(FFN, torch.randn(128, 64).bfloat16(), conf)
        refused(write_checkpoint(tmp_path / str(len(conf)), tensors), FFN, "convrot")


def test_unknown_comfy_format_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("comfy_kitchen")
    tensors = comfy_layer(FFN, torch.randn(128, 64).bfloat16())
    tensors[f"{TO_Q}.weight"] = torch.randint(-8, 8, (64, 64), dtype=torch.int8).float().bfloat16()
    tensors[f"{TO_Q}.comfy_quant"] = marker_tensor({"format": "int8_tensorwise"})
    refused(
        write_checkpoint(tmp_path / "c", tensors),
        TO_Q,
        "unknown or mismatched Comfy format 'int8_tensorwise'",
    )


def test_pre_quant_scale_that_cannot_be_folded_is_refused(tmp_path: Path) -> None:
    tensors = modelopt_tensors()
    tensors[f"{FFN}.pre_quant_scale"] = torch.ones(65)
    refused(variant(tmp_path / "shape", tensors), FFN, "pre_quant_scale", "cannot be folded", "(64,)")
    tensors[f"{FFN}.pre_quant_scale"] = torch.linspace(-1, 1, 64)
    layer = detect_nvfp4(variant(tmp_path / "values", tensors)).layers[FFN]
    with pytest.raises(SourceError, match=rf"{FFN}.*not finite and > 0.*ignored_layers"):
        load_mul_scale(layer, tensors.__getitem__)
    tensors[f"{FFN}.pre_quant_scale"] = torch.full((64,), 0.5)
    layer = detect_nvfp4(variant(tmp_path / "ok", tensors)).layers[FFN]
    assert torch.equal(load_mul_scale(layer, tensors.__getitem__), torch.full((64,), 0.5))


def test_svdquant_is_refused(tmp_path: Path) -> None:
    tensors = modelopt_tensors()
    tensors[f"{FFN}.svdquant_lora_a"] = torch.zeros(8, 64).bfloat16()
    refused(variant(tmp_path / "branch", tensors), FFN, "SVDQuant low-rank branch", "svdquant_lora_a")
    refused(
        variant(tmp_path / "algo", config=modelopt_config() | {"quant_algo": "NVFP4_SVD"}),
        "NVFP4_SVD",
        "SVDQuant",
    )


def test_unknown_algorithms_are_refused(tmp_path: Path) -> None:
    config = modelopt_config() | {"quant_algo": "NVFP8_FANCY"}
    refused(variant(tmp_path / "top", config=config), "unknown quant_algo 'NVFP8_FANCY'")
    path, nested = mixed_nested(tmp_path)
    nested["quantization"]["quantized_layers"][TO_Q] = {"quant_algo": "INT4_AWQ"}
    (path / "hf_quant_config.json").write_text(json.dumps(nested))
    refused(path, TO_Q, "unknown quant_algo 'INT4_AWQ'")


def test_unidentifiable_scale_layout_is_refused(tmp_path: Path) -> None:
    tensors = modelopt_tensors()
    tensors[f"{TO_Q}.weight_scale"] = torch.ones(65, 4).to(torch.float8_e4m3fn)
    refused(variant(tmp_path, tensors), TO_Q, "neither linear (64, 4) nor swizzled (128, 4)")


def test_ambiguous_scale_layout_without_evidence_is_refused(tmp_path: Path) -> None:
    """Header metadata (post-processing) and only layers whose shapes fit both layouts."""
    tensors = {k: v for k, v in modelopt_tensors("swizzled").items() if k.startswith(FFN)}
    metadata = {"quantization_config": json.dumps(modelopt_config())}
    refused(
        variant(tmp_path, tensors, metadata=metadata),
        FFN,
        "cannot tell linear from swizzled",
        "checkpoint_weight_scale_layout",
    )


def test_declared_layout_contradicting_the_shapes_is_refused(tmp_path: Path) -> None:
    config = modelopt_config() | {"checkpoint_weight_scale_layout": "swizzled"}
    refused(
        variant(tmp_path, config=config), "blocks.0.attn1.to_k", "declares swizzled", "fits only ['linear']"
    )


def test_shapes_contradicting_the_group_size_are_refused(tmp_path: Path) -> None:
    config = modelopt_config()
    config["config_groups"]["group_0"]["weights"]["group_size"] = 32
    refused(variant(tmp_path / "config", config=config), "group_size 32 contradicts NVFP4's 16")
    tensors = modelopt_tensors()
    tensors[f"{TO_Q}.weight_scale"] = torch.ones(64, 8).to(torch.float8_e4m3fn)
    refused(variant(tmp_path / "shape", tensors), TO_Q, "contradicts the group size 16")


def test_excluded_layer_stored_as_nvfp4_is_refused(tmp_path: Path) -> None:
    config = modelopt_config()
    config["ignore"] = [*config["ignore"], "blocks.0.attn1.*"]
    refused(
        variant(tmp_path, config=config),
        "blocks.0.attn1.",
        "stored as NVFP4 but excluded by ignore pattern 'blocks.0.attn1.*'",
    )


def test_missing_global_scale_and_declarations_contradicting_the_tensors_are_refused(tmp_path: Path) -> None:
    tensors = modelopt_tensors()
    del tensors[f"{FFN}.weight_scale_2"]
    refused(variant(tmp_path / "global", tensors), FFN, "float32 scalar weight_scale_2")
    path, nested = mixed_nested(tmp_path)
    layers = nested["quantization"]["quantized_layers"]
    layers["proj_out"] = {"quant_algo": "NVFP4", "group_size": 16}
    (path / "hf_quant_config.json").write_text(json.dumps(nested))
    refused(path, "proj_out", "declared NVFP4 but stored as BF16")
    del layers["proj_out"]
    layers[FFN] = {"quant_algo": "FP8"}
    (path / "hf_quant_config.json").write_text(json.dumps(nested))
    refused(path, FFN, "stored as NVFP4 but declared FP8")
    del layers[FFN]
    (path / "hf_quant_config.json").write_text(json.dumps(nested))
    refused(path, FFN, "stored as NVFP4 but not listed in quantized_layers")


def test_every_exclude_key_is_read_with_glob_and_regex_patterns() -> None:
    config = parse_quant_config(
        {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "ignore": ["proj_out"],
            "exclude_modules": ["*.norm_out.*"],
            "exclude": ["re:blocks\\.3\\.ffn"],
        },
        "config.json quantization_config",
    )
    assert config.excluded_by("proj_out") == "ignore pattern 'proj_out'"
    assert config.excluded_by("x.norm_out.linear") == "exclude_modules pattern '*.norm_out.*'"
    assert config.excluded_by("blocks.3.ffn.net.0.proj") == "exclude pattern 're:blocks\\\\.3\\\\.ffn'"
    assert config.excluded_by("blocks.13.ffn.net.0.proj") is None  # re: matches from the start
    with pytest.raises(SourceError, match=r"config\.json quantization_config: 'ignore' must be a list"):
        parse_quant_config(
            {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": "proj_out"},
            "config.json quantization_config",
        )
