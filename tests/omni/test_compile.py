"""torch.compile (inductor on the CPU) of both Wan2.2 experts with quantized Linears, as vLLM-Omni's
model runner compiles them: ``regionally_compile`` of each expert's repeated blocks.

Upstream's users met an expert left uncompiled (vllm-omni #1535). Here both experts of the tiny
two-expert pipeline are compiled with every method: quantized at load (W4A8 by step and by layer,
DualScale, the low-rank branch) and stored (an offline ``mxfp4`` checkpoint with Smooth factors and
MXFP8 blocks, an offline DualScale expert, an NVFP4 checkpoint served with ``mxfp4``); the quantized
Linear is one
opaque custom op (``vllm_omni_mxfp4::linear``), so the graphs hold it and break nowhere, and the
precision of a denoising step (W4A8 by step) is decided inside the op, so a new step compiles
nothing. Compiled output equals eager up to inductor's own fusion of the BF16 elementwise work
around the op (norms, modulation, attention), which the bound below states.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.support.bundles import STORED, require_bundle
from tests.support.layers import build_expert, forward, quantized_layers
from tests.support.metrics import cosine
from vllm_omni_mxfp4.steps import denoise_step

pytestmark = [
    pytest.mark.omni,
    pytest.mark.skipif(
        shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler"
    ),
]

SPECS = {
    "mxfp4 w4a8 steps and layer": {
        "method": "mxfp4", "w4a8_fallback_steps": [1], "w4a8_fallback_layers": ["blocks.0.ffn.net_2"],
        "backend": "emulated",
    },
    "mxfp4_dualscale": {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0, "backend": "emulated"},
    "mxfp4 svd_rank": {"method": "mxfp4", "svd_rank": 8, "backend": "emulated"},
}  # fmt: skip
A8_STEPS = [1]


def _experts(env, tiny, root, name):
    """Both experts of case ``name``: a spec of :data:`SPECS` quantizing the BF16 model at load, or a
    bundle whose ``transformer`` is stored quantized (offline ``mxfp4`` with Smooth and MXFP8 blocks
    next to an offline DualScale expert; an NVFP4 checkpoint served with ``mxfp4`` and W4A8 by step
    next to DualScale at load)."""
    from tests.support.bundles import bundle
    from tests.support.nvfp4.checkpoints import build_via_pipeline

    if name in SPECS:
        return {sub: build_expert(env, tiny, SPECS[name], sub) for sub in ("transformer", "transformer_2")}
    model, kwargs = bundle(name, tiny, root, A8_STEPS)
    config = kwargs.get("quantization_config", {})
    if name == "checkpoint":  # each expert's config.json says how it is stored
        return {sub: build_expert(env, model, None, sub) for sub in ("transformer", "transformer_2")}
    return {
        "transformer": build_via_pipeline(env, model, config["transformer"], "transformer"),
        "transformer_2": build_expert(env, model, config["transformer_2"], "transformer_2"),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", [*SPECS, *STORED])
def test_both_experts_compile_with_quantized_linears_without_breaks_or_recompiles(
    request, vllm_env, tiny_dir, tmp_path, name
):
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx
    from vllm_omni.diffusion.compile import regionally_compile

    graphs = []

    def inductor(gm, example_inputs):  # inductor, counting the graphs it is given
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    require_bundle(request.config, name)  # the stored engines' experts run with --all-bundles
    experts = _experts(vllm_env, tiny_dir, tmp_path, name)
    eager = {}
    for sub, model in experts.items():
        assert quantized_layers(model), sub
        eager[sub] = [_step(vllm_env, model, step) for step in range(3)]

    torch._dynamo.reset()
    counters.clear()
    for sub, model in experts.items():
        regionally_compile(model, backend=inductor)
        out = _step(vllm_env, model, 0)
        assert cosine(out, eager[sub][0]) > 0.9999, sub
    compiled_graphs = len(graphs)
    assert compiled_graphs >= 1
    for sub, model in experts.items():  # every block of both experts ran compiled
        for block in model.blocks:
            assert "compile" in type(block.forward).__name__.lower() or hasattr(
                block.forward, "_torchdynamo_orig_callable"
            ), sub
        for step in (1, 2):  # W4A8 on step 1, W4A4 on step 2: the same graphs
            out = _step(vllm_env, model, step)
            assert cosine(out, eager[sub][step]) > 0.9999, (sub, step)
    assert len(graphs) == compiled_graphs  # no recompilation for a new step or the second expert's pass
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    targets = {str(n.target) for gm in graphs for n in gm.graph.nodes}
    assert "vllm_omni_mxfp4.linear.default" in targets or "vllm_omni_mxfp4.linear" in targets, targets


def _step(env, model, step):
    with denoise_step(step):
        return forward(env, model)
