"""One NVFP4 routing decision: serving, ``convert`` and ``inspect`` say the same of every runtime Linear.

The case where they once disagreed: a fused Q/K/V group with one part stored unquantized by the
producer (its ``ignore`` list) and the others NVFP4. vLLM-Omni fuses the three into one Linear,
which runs in one precision, so all three must agree that it runs in BF16, for the same reason,
and none may call it an error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.nvfp4.checkpoints import MODELOPT_FIXTURES
from vllm_omni_mxfp4.config import LayerRoute, Mxfp4Config, Precision
from vllm_omni_mxfp4.formats.nvfp4 import Nvfp4Weight, dequantize_nvfp4
from vllm_omni_mxfp4.sources.nvfp4 import detect_nvfp4
from vllm_omni_mxfp4.sources.nvfp4.routing import decide_linear, part_action

WEIGHTS = "diffusion_pytorch_model.safetensors"
QKV = "blocks.0.attn1.to_qkv"
PARTS = [f"blocks.0.attn1.to_{p}" for p in "qkv"]


@pytest.fixture(scope="module")
def mixed_group(tmp_path_factory) -> Path:
    """ModelOpt's NVFP4 export of the tiny Wan2.2 transformer with ``to_v`` kept in BF16."""
    import shutil

    directory = tmp_path_factory.mktemp("mixed-qkv") / "transformer"
    shutil.copytree(MODELOPT_FIXTURES / "nvfp4", directory)
    tensors = load_file(directory / WEIGHTS)
    v = PARTS[2]
    weight = Nvfp4Weight(tensors[f"{v}.weight"], tensors[f"{v}.weight_scale"], tensors[f"{v}.weight_scale_2"])
    for leaf in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
        tensors.pop(f"{v}.{leaf}", None)
    tensors[f"{v}.weight"] = dequantize_nvfp4(weight).to(torch.bfloat16)
    save_file(tensors, str(directory / WEIGHTS), {"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["ignore"].append(v)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_the_decision_keeps_a_mixed_fused_group_in_bf16(mixed_group):
    layers = detect_nvfp4(mixed_group).layers
    decision = decide_linear([layers[p] for p in PARTS], quantizable=True, runtime=QKV)
    assert (decision.method, decision.precision) == ("bf16", "bf16")
    assert f"fused at runtime into {QKV} with {PARTS[2]}" in decision.reason
    assert [part_action(layers[p], decision) for p in PARTS] == ["bf16", "bf16", "kept"]
    alone = decide_linear([layers[PARTS[0]]], quantizable=True)
    assert alone.quantized and alone.precision == "w4a4"
    assert decide_linear([layers[PARTS[0]]], quantizable=False).method == "bf16"


def test_serving_convert_and_inspect_agree_on_the_mixed_group(mixed_group, tmp_path):
    from vllm_omni_mxfp4.convert import convert
    from vllm_omni_mxfp4.hooks.nvfp4_loading import Nvfp4Plan
    from vllm_omni_mxfp4.inspection import inspect_path

    checkpoint = detect_nvfp4(mixed_group)
    want = decide_linear([checkpoint.layers[p] for p in PARTS], True, runtime=QKV).reason

    plan = Nvfp4Plan.of(
        "transformer", mixed_group, checkpoint, Mxfp4Config(is_checkpoint_mxfp4_serialized=True)
    )
    route = plan.route(QKV, LayerRoute(Precision.W4A4, (), "", QKV))
    assert route.precision is Precision.BF16 and want in route.reason and QKV not in plan.mx_layers

    report = convert(mixed_group, tmp_path / "out", progress=False)
    converted = {layer.name: layer for layer in report.components[0].layers}
    assert [converted[p].action for p in PARTS] == ["bf16", "bf16", "kept"]
    assert all(converted[p].reason == want for p in PARTS)
    assert QKV in report.components[0].ignored_layers

    inspected = inspect_path(mixed_group)
    assert inspected.ok, inspected.problems
    row = next(r for r in inspected.components[0].layers if r.name == QKV)
    assert (row.method, row.precision, row.reason, row.problems) == ("bf16", "bf16", want, [])
