"""``convert`` beyond its two fixed tables: any vLLM-Omni transformer class, its Linears told by the
class itself (the runtime names the merge derives), and the fixed Wan2.2 table checked against them.

The FLUX.1-dev transformer is packed to NVFP4 by compressed-tensors itself (every 2-D weight), then
converted; vLLM-Omni's own loader loads the result (auto-detected offline MXFP4) and its forward is
compared with the same class loaded from the exact dequant of the NVFP4 weights in BF16.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support import flux1_export, msmodelslim_sd
from tests.support.metrics import cosine
from tests.support.nvfp4.checkpoints import MODELOPT_FIXTURES, dequantized_copy, pack_component
from vllm_omni_mxfp4.checkpoint import CheckpointError
from vllm_omni_mxfp4.convert import convert
from vllm_omni_mxfp4.convert.targets import TARGETS
from vllm_omni_mxfp4.models import derive_names
from vllm_omni_mxfp4.models.names import DIFFUSERS_EXPORT_NAMES, ModelNames
from vllm_omni_mxfp4.sources.nvfp4 import detect_nvfp4


@pytest.fixture(scope="module")
def flux1_nvfp4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("flux1") / "nvfp4"
    flux1_export.build_pipeline(root)
    return root, pack_component(root / "transformer")


def test_a_flux1_checkpoint_converts_by_the_class_names_and_serves(
    flux1_nvfp4: tuple[Path, list[str]], tmp_path: Path, vllm_env
) -> None:
    source, packed = flux1_nvfp4
    report = convert(source, tmp_path / "mxfp4", scale_rule="mse", progress=False)
    [component] = report.components
    actions = {layer.name: layer.action for layer in component.layers if layer.action != "kept"}
    assert set(actions) == set(packed) and component.model_class == "FluxTransformer2DModel"
    # what vLLM-Omni's FluxTransformer2DModel quantizes (flux1_export.INCLUDE, read from its code)
    single = {name for name in packed if any(fnmatch.fnmatch(name, p) for p in flux1_export.INCLUDE)}
    assert len(single) == 5
    assert {name for name, action in actions.items() if action == "mxfp4"} == single
    assert all(actions[name] == "bf16" for name in set(packed) - single)
    assert component.ignored_layers == []

    engine = flux1_export.engine_transformer(vllm_env, tmp_path / "mxfp4")
    running = msmodelslim_sd.running_mx_layers(engine)
    assert running and all(name.startswith("single_transformer_blocks.") for name in running)
    got = flux1_export.engine_forward(vllm_env, engine)
    reference = flux1_export.engine_transformer(vllm_env, dequantized_copy(source, tmp_path / "bf16"))
    want = flux1_export.engine_forward(vllm_env, reference)
    assert cosine(got, want) > 0.99


def test_a_tensor_the_class_does_not_load_is_refused(
    flux1_nvfp4: tuple[Path, list[str]], tmp_path: Path
) -> None:
    source = tmp_path / "in"
    shutil.copytree(flux1_nvfp4[0] / "transformer", source)
    [path] = sorted(source.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors["single_transformer_blocks.0.attn.to_z.bias"] = torch.zeros(4, dtype=torch.bfloat16)
    save_file(tensors, str(path), {"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        convert(source, tmp_path / "out", progress=False)
    message = str(info.value)
    assert "single_transformer_blocks.0.attn.to_z.bias" in message and "FluxTransformer2DModel" in message
    assert not (tmp_path / "out").exists()


def test_the_fixed_wan_table_agrees_with_the_class() -> None:
    """The convert's hand table for Wan2.2 (no vLLM-Omni needed at convert time) says what vLLM-Omni's
    class says, for every Linear of the tiny ModelOpt export."""
    directory = MODELOPT_FIXTURES / "nvfp4"
    config = json.loads((directory / "config.json").read_text())
    checkpoint = detect_nvfp4(directory)
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(directory / "diffusion_pytorch_model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            module, _, param = key.rpartition(".")
            stored, layer = f.get_slice(key), checkpoint.layers.get(module)
            if layer is None or layer.action != "requantize" or param == "bias":
                tensors[key] = (stored.get_dtype(), tuple(stored.get_shape()))
            elif param == "weight":  # its scales have no place in the BF16 original
                tensors[key] = ("BF16", tuple(layer.shape))
    names = ModelNames.from_dict(
        derive_names("WanPipeline", "WanTransformer3DModel", config, tensors), DIFFUSERS_EXPORT_NAMES
    )
    fixed = TARGETS["WanTransformer3DModel"]
    layers = names.linear_layers()
    assert len(layers) > 10
    for layer in layers:
        assert fixed.quantizable(layer) == names.is_runtime_quantizable(layer), layer
        if names.is_runtime_quantizable(layer):
            assert fixed.runtime_name(layer) == names.runtime_layer_name(layer), layer
