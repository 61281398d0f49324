"""The text-to-video example: its command line without a model, and once end to end on the tiny model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from tests.platform.omni_procs import omni_installed, run_bounded, subprocess_env

EXAMPLE = Path(__file__).resolve().parents[2] / "examples/offline_inference/text_to_video/text_to_video.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("text_to_video_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exit_code_and_stderr(example, argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        example.build_parser().parse_args(argv)
    return info.value.code, capsys.readouterr().err


def test_quantization_flags_are_mutually_exclusive(example, capsys):
    argv = ["--model", "m", "--quantization", "mxfp4", "--quantization-config", '{"method":"mxfp4"}']
    with pytest.raises(SystemExit) as info:
        example.main(argv)  # fails while parsing, before any engine import
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "--quantization-config: not allowed with argument --quantization" in err


def test_json_string_is_parsed_into_a_dict(example):
    text = '{"method": "mxfp4", "w4a8_fallback_steps": [0, 2], "mxfp4_scale_alg": 2}'
    args = example.build_parser().parse_args(["--model", "m", "--quantization-config", text])
    assert args.quantization_config == {
        "method": "mxfp4",
        "w4a8_fallback_steps": [0, 2],
        "mxfp4_scale_alg": 2,
    }
    assert args.quantization is None
    kwargs = example.omni_kwargs(args)
    assert kwargs["quantization_config"] == args.quantization_config
    assert "quantization" not in kwargs


def test_json_file_is_parsed_into_a_dict(example, tmp_path):
    config = {"transformer": {"method": "mxfp4"}, "transformer_2": {"method": "mxfp4_dualscale"}}
    path = tmp_path / "quant.json"
    path.write_text(json.dumps(config))
    args = example.build_parser().parse_args(["--model", "m", "--quantization-config", str(path)])
    assert args.quantization_config == config


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"method": "mxfp4",', "the JSON string is not valid JSON"),
        ("/no/such/quant.json", "is neither a JSON object"),
        ("mxfp4", "is neither a JSON object"),
        ('{"method": "mxfp4_dualscale", "w4a8_fallback_steps": [0]}', "does not support W4A8 fallback"),
        ('{"method": "mxfp4", "ignored_layer": []}', "ignored_layer"),
    ],
)
def test_bad_quantization_config_exits_2_with_the_reason(example, capsys, value, message):
    code, err = _exit_code_and_stderr(example, ["--model", "m", "--quantization-config", value], capsys)
    assert code == 2
    assert "argument --quantization-config" in err and message in err


ENGINE_CASES = [  # (config, accepted by the engine)
    ({"transformer": "mxfp4", "transformer_2": "mxfp4_dualscale"}, True),  # the user guide's forms
    ({"default": "mxfp4"}, True),
    ({"transformer": "mxfp4", "default": {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0}}, True),
    ({"transformer": {"method": "mxfp4", "w4a8_fallback_steps": [0]}, "transformer_2": None}, True),
    ({"transformer": "mxfp4", "transformer_2": "fp8"}, True),  # another method of vLLM-Omni
    ({"method": "mxfp4", "ignored_layers": ["blocks.0.attn1.to_qkv"]}, True),
    ({"transformer": "mxfp4", "transformer_2": "mxfp4_dualscal"}, False),  # unknown method
    ({"transformer": " mxfp4 "}, False),  # vLLM-Omni does not strip a component's method name
    ({"transformer": {"method": "mxfp4", "ignored_layers": ["blocks.0.attn1.to_q"]}}, False),
    ({"method": "mxfp4_dualscale", "w4a8_fallback_layers": ["blocks.0.attn1.to_qkv"]}, False),
    ({"default": {"method": "mxfp4", "num_bf16_fallback_layers": 1}}, False),  # the other method's key
]


@pytest.mark.omni
@pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed")
@pytest.mark.parametrize(("config", "accepted"), ENGINE_CASES, ids=[json.dumps(c) for c, _ in ENGINE_CASES])
def test_the_example_accepts_exactly_what_the_engine_accepts(example, capsys, config, accepted):
    """The engine here is what Omni(quantization_config=...) and `vllm serve --omni
    --diffusion-quantization-config` build: vLLM-Omni's OmniDiffusionConfig with the plugin loaded."""
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    from vllm_omni_mxfp4.plugin import register

    register()
    try:
        OmniDiffusionConfig(model=None, quantization_config=json.loads(json.dumps(config)))
        engine_error = None
    except (ValueError, TypeError) as exc:
        engine_error = str(exc)
    assert (engine_error is None) == accepted, engine_error
    text = json.dumps(config)
    if engine_error is None:
        args = example.build_parser().parse_args(["--model", "m", "--quantization-config", text])
        assert args.quantization_config == config
    else:
        code, err = _exit_code_and_stderr(example, ["--model", "m", "--quantization-config", text], capsys)
        assert code == 2 and engine_error.split(".")[0] in " ".join(err.split())


def test_json_file_errors_name_the_file(example, capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    code, err = _exit_code_and_stderr(example, ["--model", "m", "--quantization-config", str(bad)], capsys)
    assert code == 2 and str(bad) in err and "must hold a JSON object" in err


def test_method_name_and_parallel_flags_reach_omni(example, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "boundary_ratio": 0.9}))
    argv = ["--model", str(model), "--quantization", "mxfp4_dualscale", "--tensor-parallel-size", "2"]
    argv += ["--ulysses-degree", "2", "--cfg-parallel-size", "2", "--enforce-eager"]
    kwargs = example.omni_kwargs(example.build_parser().parse_args(argv))
    assert kwargs["quantization"] == "mxfp4_dualscale" and "quantization_config" not in kwargs
    assert (kwargs["tensor_parallel_size"], kwargs["ulysses_degree"], kwargs["cfg_parallel_size"]) == (
        2,
        2,
        2,
    )
    assert kwargs["enforce_eager"] is True
    assert kwargs["boundary_ratio"] == 0.9  # from model_index.json
    kwargs = example.omni_kwargs(example.build_parser().parse_args([*argv, "--boundary-ratio", "0.5"]))
    assert kwargs["boundary_ratio"] == 0.5


def test_no_quantization_flag_means_auto_detection(example):
    kwargs = example.omni_kwargs(example.build_parser().parse_args(["--model", "hub/id"]))
    assert "quantization" not in kwargs and "quantization_config" not in kwargs
    assert "boundary_ratio" not in kwargs  # not a local pipeline: vLLM-Omni's default applies


@pytest.mark.slow
@pytest.mark.omni
@pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed")
def test_example_end_to_end_on_the_tiny_model(tmp_path):
    """Per-expert config from a file; the printed methods match the layers the trace saw running."""
    from vllm_omni_mxfp4_tiny import build_tiny_wan

    config = {
        "transformer": {"method": "mxfp4", "w4a8_fallback_steps": [0]},
        "transformer_2": {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 1},
    }
    (tmp_path / "quant.json").write_text(json.dumps(config))
    trace = tmp_path / "trace.jsonl"
    output = tmp_path / "video.mp4"
    argv = [
        str(EXAMPLE),
        "--model",
        str(build_tiny_wan(2)),
        "--quantization-config",
        str(tmp_path / "quant.json"),
    ]
    argv += ["--height", "32", "--width", "32", "--num-frames", "9", "--num-inference-steps", "2"]
    argv += ["--output", str(output)]
    log = tmp_path / "example.log"
    run_bounded(argv, timeout=400, env=subprocess_env({"VLLM_OMNI_MXFP4_TRACE_FILE": str(trace)}), log=log)
    text = log.read_text()

    assert "Platform: CpuOmniPlatform" in text
    lines = {name: next(line for line in text.splitlines() if f"  {name}: " in line) for name in config}
    assert (
        "16 Linears: 16 mxfp4 online W4A4 (W4A8 on steps [0]) [backend emulated, A4 scale OCP]"
        in lines["transformer"]
    )
    assert "8 mxfp4_dualscale online W4A4 [backend emulated" in lines["transformer_2"]
    assert "8 BF16" in lines["transformer_2"]
    # What was printed is what ran: the trace records every quantized Linear call in the engine.
    calls = [json.loads(line) for line in trace.read_text().splitlines()]
    by_method = {m: {c["prefix"] for c in calls if c["method"] == m} for m in ("mxfp4", "mxfp4_dualscale")}
    assert len(by_method["mxfp4"]) == 16
    assert len(by_method["mxfp4_dualscale"]) == 8 and all(
        p.startswith("blocks.1.") for p in by_method["mxfp4_dualscale"]
    )
    assert {c["backend"] for c in calls} == {"emulated"}

    assert f"Saved video to {output}" in text
    import imageio.v3 as iio

    frames = iio.imread(output, index=None)
    assert frames.shape == (9, 32, 32, 3) and frames.dtype == np.uint8
    assert frames.std() > 0  # not a blank video
