"""The tuning engine's worker side on real vLLM Linears with this package's method, in this process.

Each plan must run a Linear exactly as serving would: ``bf16`` as vLLM's own unquantized Linear on
the same weights, ``w4a4`` / ``w4a8`` as the layer's own MXFP4 method at that precision; a scoring
pass must return the BF16 output and add exactly the error sums of the quantized outputs. The
extension's RPCs are driven on a pipeline module holding the layer.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.layers import env_vars, load, make_layer, run, weights
from vllm_omni_mxfp4.config import Precision
from vllm_omni_mxfp4.steps import denoise_step
from vllm_omni_mxfp4.tune.engine import TUNER, TunedLinearMethod, TuneExtension

SPEC = {"method": "mxfp4", "backend": "emulated"}
PREFIX = "blocks.1.attn2.to_q"
KEY = f"transformer/{PREFIX}"


def online_layer(env, keep: bool = True):
    w, b, x = weights()
    layer = make_layer(env, SPEC, prefix=PREFIX)
    with env_vars(VLLM_OMNI_MXFP4_KEEP_BF16="1" if keep else "0"):
        load(layer, "weight", w)  # online: quantized when the last element arrives
    load(layer, "bias", b)
    return layer, w, b, x


def bf16_layer(env, w, b):
    """vLLM's unquantized Linear with the same weights: what a BF16 layer computes in serving."""
    layer = make_layer(env, None, prefix=PREFIX)
    load(layer, "weight", w)
    load(layer, "bias", b)
    with env.context():
        layer.quant_method.process_weights_after_loading(layer)
    return layer


class Runner:
    """A worker's ``model_runner`` whose pipeline holds one transformer with the layer."""

    def __init__(self, layer):
        self.pipeline = torch.nn.Module()
        self.pipeline.transformer = torch.nn.Module()
        self.pipeline.transformer.blocks = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
        self.pipeline.transformer.blocks[1].attn2 = torch.nn.Module()
        self.pipeline.transformer.blocks[1].attn2.to_q = layer


def extension(layer) -> TuneExtension:
    ext = TuneExtension.__new__(TuneExtension)
    ext.model_runner = Runner(layer)
    return ext


def test_keep_bf16_keeps_the_loaded_weight_only_when_asked(vllm_env):
    layer, w, _, _ = online_layer(vllm_env)
    assert torch.equal(layer._mx.bf16_weight, w)
    assert layer.weight.dtype == torch.uint8  # the layer itself holds the packed weight
    assert "bf16_weight" not in layer.state_dict()
    assert online_layer(vllm_env, keep=False)[0]._mx.bf16_weight is None


def test_each_plan_runs_the_serving_arithmetic(vllm_env):
    layer, w, b, x = online_layer(vllm_env)
    w4a4 = run(vllm_env, layer, x)
    with vllm_env.context(), torch.no_grad():
        w4a8 = layer.quant_method.forward(layer, x, layer.bias, Precision.W4A8)
    bf16 = run(vllm_env, bf16_layer(vllm_env, w, b), x)
    ext = extension(layer)
    setup = ext.mxfp4_tune_setup()
    assert isinstance(layer.quant_method, TunedLinearMethod)
    assert setup["units"] == [
        {
            "component": "transformer",
            "layer": PREFIX,
            "method": "mxfp4",
            "n": 96,
            "k": 256,
            "block": 1,
            "w4a8": True,
            "route": "w4a4",
        }
    ]
    assert ext.mxfp4_tune_setup() == setup  # idempotent: wrapped once
    for plan, expected in (({"default": "bf16"}, bf16), ({"layers": {KEY: "w4a8"}}, w4a8), ({}, w4a4)):
        ext.mxfp4_tune_plan(plan)
        assert torch.equal(run(vllm_env, layer, x), expected), plan
    ext.mxfp4_tune_plan({"a8_steps": [2]})
    with denoise_step(2):
        assert torch.equal(run(vllm_env, layer, x), w4a8)
    with denoise_step(1):
        assert torch.equal(run(vllm_env, layer, x), w4a4)
    assert not torch.equal(w4a4, w4a8) and not torch.equal(w4a4, bf16)


def test_a_scoring_pass_returns_bf16_and_adds_the_error_sums(vllm_env):
    layer, w, b, x = online_layer(vllm_env)
    bf16 = run(vllm_env, bf16_layer(vllm_env, w, b), x)
    ext = extension(layer)
    ext.mxfp4_tune_setup()
    ext.mxfp4_tune_plan({})
    w4a4 = run(vllm_env, layer, x)
    ext.mxfp4_tune_plan({"layers": {KEY: "w4a8"}})
    w4a8 = run(vllm_env, layer, x)
    ext.mxfp4_tune_plan({"scoring": True})
    with denoise_step(0):
        assert torch.equal(run(vllm_env, layer, x), bf16)
    with denoise_step(3):
        run(vllm_env, layer, x)
    rows = {(r[0], r[1], r[2]): r[3:] for r in ext.mxfp4_tune_stats()["local"]}
    assert set(rows) == {(KEY, s, p) for s in (0, 3) for p in ("w4a4", "w4a8")}
    for precision, out in (("w4a4", w4a4), ("w4a8", w4a8)):
        o, r = out.double(), bf16.double()
        expected = [((o - r) ** 2).sum(), (r * r).sum(), (o * r).sum(), (o * o).sum()]
        assert rows[(KEY, 0, precision)] == pytest.approx([float(v) for v in expected], rel=1e-12)
    ext.mxfp4_tune_plan({})
    assert ext.mxfp4_tune_stats() == {"local": [], "steps": []}  # a new plan starts new sums
    assert TUNER.scoring is False


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"layers": {"transformer/blocks.1.attn2.to_k": "bf16"}}, "not quantized in this engine"),
        ({"layers": {KEY: "fp8"}}, "expected one of bf16, w4a8, w4a4"),
        ({"default": "int4"}, "expected one of"),
    ],
)
def test_a_bad_plan_is_refused(vllm_env, plan, message):
    ext = extension(online_layer(vllm_env)[0])
    ext.mxfp4_tune_setup()
    with pytest.raises(ValueError, match=message):
        ext.mxfp4_tune_plan(plan)


def test_bf16_needs_the_kept_weight(vllm_env):
    layer, _, _, x = online_layer(vllm_env, keep=False)
    ext = extension(layer)
    ext.mxfp4_tune_setup()
    ext.mxfp4_tune_plan({"default": "bf16"})
    with pytest.raises(
        RuntimeError, match="no BF16 weight was kept; tune quantizes a BF16 checkpoint online"
    ):
        run(vllm_env, layer, x)
    ext.mxfp4_tune_plan({})
