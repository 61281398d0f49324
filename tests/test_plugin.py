"""The plugin entry point: picked up by vLLM-Omni in a fresh process, scoped to diffusion."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.omni

CHILD = textwrap.dedent(
    """
    import json
    from vllm_omni.quantization.factory import build_quant_config
    before = type(build_quant_config("mxfp4")).__module__
    from vllm_omni.plugins import load_omni_general_plugins
    load_omni_general_plugins()
    load_omni_general_plugins()  # once per process; a second call must be harmless
    from vllm_omni.quantization import build_quant_config as build
    from vllm.model_executor.layers.quantization import get_quantization_config
    out = {
        "before": before,
        "name": type(build("mxfp4")).__name__,
        "dual": type(build("mxfp4_dualscale")).__name__,
        "dict": type(build({"quant_method": "mxfp4", "w4a8_fallback_steps": [1]})).__name__,
        "checkpoint": build({"quant_method": "mxfp4_dualscale", "is_checkpoint_serialized": True,
                             "ignored_layers": ["blocks.0.attn1.to_qkv"]}).config.ignored_layers,
        "component": {k: type(v).__name__ for k, v in
                      build({"transformer": {"method": "mxfp4"}, "transformer_2": None}).component_configs.items()},
        "vllm_core_mxfp4": get_quantization_config("mxfp4").__module__,
    }
    print("RESULT" + json.dumps(out))
    """
)


def test_entry_point_registers_both_methods_in_a_fresh_process():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    out = json.loads(line[len("RESULT") :])
    assert out["before"].startswith("vllm_omni.quantization")  # upstream's until plugins load
    assert out["name"] == "Mxfp4QuantizationConfig"
    assert out["dual"] == "Mxfp4DualScaleQuantizationConfig"
    assert out["dict"] == "Mxfp4QuantizationConfig"
    assert out["checkpoint"] == ["blocks.0.attn1.to_qkv"]
    assert out["component"] == {"transformer": "Mxfp4QuantizationConfig", "transformer_2": "NoneType"}
    # vLLM core's own mxfp4 (its MoE method for LLM stages) is untouched.
    assert out["vllm_core_mxfp4"].startswith("vllm.model_executor.layers.quantization")


def test_entry_points_are_declared():
    from importlib.metadata import entry_points

    general = {e.name: e.value for e in entry_points(group="vllm_omni.general_plugins")}
    assert general["mxfp4"] == "vllm_omni_mxfp4.plugin:register"
    platforms = {e.name: e.value for e in entry_points(group="vllm_omni.platform_plugins")}
    assert platforms["cpu"] == "vllm_omni_mxfp4.platform:activate"


def test_our_builder_accepts_json_strings_and_files(tmp_path):
    from vllm_omni.quantization.component_config import ComponentQuantizationConfig

    from vllm_omni_mxfp4.omni import build_quant_config

    qc = build_quant_config('{"method": "mxfp4", "w4a8_fallback_steps": [3, 0]}')
    assert qc.w4a8_fallback_steps == [0, 3]
    path = tmp_path / "q.json"
    path.write_text(json.dumps({"transformer": {"method": "mxfp4_dualscale"}, "default": "mxfp4"}))
    comp = build_quant_config(str(path))
    assert isinstance(comp, ComponentQuantizationConfig)
    assert comp.component_configs["transformer"].get_name() == "mxfp4_dualscale"
    assert comp.default_config.get_name() == "mxfp4"
    with pytest.raises(ValueError, match="w4a8_fallback_steps"):
        build_quant_config({"method": "mxfp4", "w4a8_fallback_steps": [-1]})
