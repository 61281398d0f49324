"""The parts of serving an NVFP4 checkpoint that need no engine: the config it is served with, the
route of each Linear, the weight stream's conversion and its end check, and the report's summary."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.support.nvfp4.checkpoints import MODELOPT_FIXTURES, fixture_tensors
from vllm_omni_mxfp4.config import LayerRoute, Mxfp4Config, Mxfp4DualScaleConfig, Precision
from vllm_omni_mxfp4.config.reconcile import nvfp4_source_config
from vllm_omni_mxfp4.hooks.nvfp4_loading import PLAN_ATTR, Nvfp4Plan, convert_stream
from vllm_omni_mxfp4.inspection.engine import LoadedTransformer
from vllm_omni_mxfp4.sources.nvfp4 import SourceError, detect_nvfp4

W4A4 = LayerRoute(Precision.W4A4, (), "W4A4", "x")


def plan_of(fixture: str, **keys) -> Nvfp4Plan:
    directory = MODELOPT_FIXTURES / fixture
    config = nvfp4_source_config(Mxfp4Config(**keys), "transformer")
    return Nvfp4Plan.of("transformer", directory, detect_nvfp4(directory), config)


def test_the_runtime_config_is_kept_with_serialized_weights():
    runtime = Mxfp4Config(
        ignored_layers=["blocks.0.ffn.net_2"], nvfp4_requant_rule="even", backend="emulated"
    )
    served = nvfp4_source_config(runtime, "transformer")
    assert served.is_checkpoint_mxfp4_serialized
    assert (served.ignored_layers, served.nvfp4_requant_rule, served.backend) == (
        ("blocks.0.ffn.net_2",),
        "even",
        "emulated",
    )


def test_dualscale_is_refused_naming_where_nvfp4_was_declared():
    with pytest.raises(
        ValueError, match=r"^transformer \(x/config.json\) declares an NVFP4 checkpoint, which "
    ):
        nvfp4_source_config(Mxfp4DualScaleConfig(), "transformer (x/config.json)")


def test_svd_rank_is_refused_for_an_nvfp4_checkpoint():
    with pytest.raises(
        ValueError, match=r"^transformer declares an NVFP4 checkpoint, and the mxfp4 config sets svd_rank 8"
    ):
        nvfp4_source_config(Mxfp4Config(svd_rank=8), "transformer")


def test_auto_rule_is_mse_and_an_explicit_rule_is_kept():
    assert plan_of("nvfp4").rule == "mse"
    assert plan_of("nvfp4", nvfp4_requant_rule="rceil").rule == "rceil"


def test_routes_follow_the_checkpoint_layers():
    plan = plan_of("mixed")
    qkv = plan.route("blocks.0.attn1.to_qkv", W4A4)
    assert qkv == W4A4 and "blocks.0.attn1.to_qkv" in plan.mx_layers  # three NVFP4 parts
    fp8 = plan.route("blocks.0.ffn.net_2", W4A4)
    assert fp8.precision is Precision.BF16 and "blocks.0.ffn.net.2 FP8 layer" in fp8.reason
    ignored = LayerRoute(Precision.BF16, (), "listed in ignored_layers", "blocks.0.attn2.to_k")
    assert plan.route("blocks.0.attn2.to_k", ignored) is ignored
    assert "blocks.0.attn2.to_k" not in plan.mx_layers
    assert plan.route("blocks.0.not_in_the_checkpoint", W4A4) is W4A4


def test_w4a16_layers_run_w4a8_and_a_w4a8_route_stays():
    plan = plan_of("w4a16")
    route = plan.route("blocks.0.attn2.to_q", W4A4)
    assert route.precision is Precision.W4A8 and "W4A16_NVFP4" in route.reason
    w4a8 = LayerRoute(Precision.W4A8, (), "listed in w4a8_fallback_layers", "blocks.0.attn2.to_q")
    assert plan.route("blocks.0.attn2.to_q", w4a8) is w4a8


def test_a_fused_projection_with_a_kept_part_runs_bf16():
    plan = plan_of("nvfp4")
    kept = plan.checkpoint.layers["blocks.0.attn1.norm_k"]  # any stored-unquantized record
    plan.checkpoint.layers["blocks.0.attn1.to_v"] = dataclasses.replace(kept, name="blocks.0.attn1.to_v")
    route = plan.route("blocks.0.attn1.to_qkv", W4A4)
    assert route.precision is Precision.BF16 and "fused at runtime into blocks.0.attn1.to_qkv" in route.reason
    assert "a fused Linear runs in one precision" in route.reason


def _model_with(plan: Nvfp4Plan) -> torch.nn.Module:
    model = torch.nn.Module()
    model.add_module("transformer", torch.nn.Module())
    setattr(model.transformer, PLAN_ATTR, plan)
    return model


def test_a_model_without_a_plan_gets_the_stream_unchanged():
    weights = iter([("transformer.x.weight", torch.zeros(1))])
    assert convert_stream(torch.nn.Module(), weights) is weights


def test_layers_are_converted_and_unknown_tensors_pass():
    plan = plan_of("nvfp4")
    stored = fixture_tensors("nvfp4")
    stream = [(f"transformer.{k}", v) for k, v in stored.items()] + [("vae.decoder.weight", torch.ones(2))]
    out = dict(convert_stream(_model_with(plan), stream))
    assert torch.equal(out["vae.decoder.weight"], torch.ones(2))
    assert torch.equal(out["transformer.proj_out.weight"], stored["proj_out.weight"])  # kept as stored
    assert not [k for k in out if k.endswith(("weight_scale_2", "input_scale"))]
    assert out["transformer.blocks.0.attn1.to_q.weight"].dtype == torch.bfloat16  # no mxfp4 Linear here
    assert len(plan.records) == 22  # 10 + 5 NVFP4 layers dequantized (no mxfp4 Linear here), 7 kept
    kept = next(r for r in plan.records if r["layer"] == "proj_out")
    assert kept["action"] == "keep" and kept["reason"].startswith("excluded by ignore pattern 'proj_out'")


def test_a_stream_that_ends_before_a_layer_is_complete_is_refused():
    plan = plan_of("nvfp4")
    stream = [
        (f"transformer.{k}", v)
        for k, v in fixture_tensors("nvfp4").items()
        if k != "blocks.0.attn1.to_k.weight_scale_2"
    ]
    with pytest.raises(SourceError) as info:
        list(convert_stream(_model_with(plan), stream))
    assert str(info.value).startswith(
        "transformer.blocks.0.attn1.to_k: the checkpoint's weight stream ended without its ['weight_scale_2']"
    )
    assert str(Path(MODELOPT_FIXTURES / "nvfp4")) in str(info.value)


def test_the_report_summary_counts_the_nvfp4_records():
    records = [
        {"layer": "a", "action": "requantize", "rule": "mse"},
        {"layer": "b", "action": "requantize", "rule": "mse"},
        {"layer": "c", "action": "dequantize"},
        {"layer": "d", "action": "keep"},
    ]
    report = LoadedTransformer("transformer", 0, 0, 0, [], nvfp4=records)
    assert report.summary().endswith(
        "; NVFP4 checkpoint: 2 layers requantized (rule mse), 1 dequantized to BF16, 1 kept as stored"
    )
