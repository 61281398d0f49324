"""Why two of Sana-WM's Linears stay BF16 whatever the config says: two upstream lines cast a Linear's
input to that Linear's weight dtype, which for a quantized Linear (ours on every device) is the packed
FP4 storage (uint8).

- ``SanaWmTimestepEmbedder.forward``: ``self.mlp[0](emb.to(dtype=self.mlp[0].weight.dtype))``;
- ``SanaWmSelfAttention._apply_output_gate_and_proj``: ``self.proj(gated.to(self.proj.weight.dtype))``.

The required family default (``vllm_omni_mxfp4/config/defaults.py``, ``SANA_WM``) keeps those two in
BF16. Without it the quantized forward stops at the first line, keeping that Linear in BF16 moves the
failure to the second; with it the forward runs. When upstream stops casting to the weight dtype,
the test of the failure fails: then drop the default and measure the model again.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from tests.support.metrics import cosine
from tests.support.models import SANA_WM, build, finish, forward, load_from, randomize

CASE = SANA_WM
CAST_LINES = {
    "t_embedder.mlp.0": "SanaWmTimestepEmbedder.forward",
    "blocks.*.attn.proj": "SanaWmSelfAttention._apply_output_gate_and_proj",
}


@pytest.fixture(scope="module")
def bf16(vllm_env):
    """(weights, BF16 output) of the tiny Sana-WM on the pipeline's inputs."""
    torch.manual_seed(0)
    model = build(vllm_env, CASE)
    randomize(model)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    finish(vllm_env, model)
    return weights, forward(vllm_env, CASE, model)


def _quantized(env, weights, kept_bf16: list[str] | None):
    spec = {"quant_method": "mxfp4"}
    if kept_bf16 is not None:
        blocks = range(CASE.extra()["config"].num_blocks)
        spec["ignored_layers"] = [
            n for p in kept_bf16 for n in ([p.replace("*", str(i)) for i in blocks] if "*" in p else [p])
        ]
    model = build(env, CASE, spec)
    load_from(env, model, weights)
    return model


def test_bf16_forward_runs_on_the_cpu_platform(bf16):
    _, out = bf16
    assert out.shape == (1, 16, 2, 4, 4) and torch.isfinite(out).all() and out.abs().max() > 0


@pytest.mark.parametrize("kept_bf16", [[], ["t_embedder.mlp.0"]])
def test_without_the_default_the_forward_casts_activations_to_the_packed_weight(
    vllm_env, bf16, kept_bf16, monkeypatch
):
    from vllm_omni_mxfp4.hooks import defaults

    monkeypatch.setattr(defaults, "with_family_default", lambda quant_config, default: quant_config)
    failing = next(name for name in CAST_LINES if name not in kept_bf16)
    model = _quantized(vllm_env, bf16[0], kept_bf16)
    with pytest.raises(TypeError, match="got torch.uint8") as info:
        forward(vllm_env, CASE, model)
    frames = [frame.f_code.co_qualname for frame, _ in traceback.walk_tb(info.tb)]
    assert CAST_LINES[failing] in frames, (
        f"Sana-WM's quantized forward no longer fails where {failing} casts its input to its packed "
        f"weight's dtype (frames: {frames}); if it runs, give SANA_WM its inputs and measure it"
    )


def test_the_default_keeps_both_cast_linears_bf16_whatever_is_listed(vllm_env):
    from vllm_omni_mxfp4.config.defaults import FAMILY_DEFAULTS

    assert FAMILY_DEFAULTS[CASE.key].bf16 == tuple(CAST_LINES) and FAMILY_DEFAULTS[CASE.key].required
    for listed in (None, ["blocks.0.attn.qkv"]):
        spec = {"quant_method": "mxfp4", **({"ignored_layers": listed} if listed else {})}
        model = build(vllm_env, CASE, spec)
        for name in ("t_embedder.mlp.0", "blocks.0.attn.proj", "blocks.1.attn.proj"):
            route = model.get_submodule(name).quant_method.route
            assert route.precision.value == "bf16" and "casts their input" in route.reason, (name, route)


@pytest.mark.parametrize("kept_bf16", [None, list(CAST_LINES)])
def test_quantized_forward_runs_with_both_cast_linears_in_bf16(vllm_env, bf16, kept_bf16):
    weights, expect = bf16
    model = _quantized(vllm_env, weights, kept_bf16)
    got = forward(vllm_env, CASE, model)
    # every other Linear quantized, embedders included, as in Krea2 (output cosine 0.88-0.90): measured 0.933
    assert cosine(got, expect) >= 0.9
