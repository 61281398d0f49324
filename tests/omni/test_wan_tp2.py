"""TP=2 (and TP=4 for DualScale) for real: processes over gloo run the tiny vLLM-Omni Wan2.2 transformer.

Each rank builds the expert with vLLM-Omni's factory and loader, then runs one forward in float32
with the emulated backend. Rank 0's output must equal a TP=1 run up to float32 summation order (and,
for W4A8 and DualScale, each rank's bf16 partial output). The ranks of each world size are started
once for the module and run every spec in turn (:data:`RUNS`); the tests check their results.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.tp_ranks import run_ranks

pytestmark = [pytest.mark.omni, pytest.mark.slow]


def _rank_runs(rank: int, world: int, env, specs: dict[str, dict], model_dir: str) -> dict:
    """On one TP rank, for each spec in turn: the expert's output (numpy, sent by value) and block 0's
    parameter shapes. One process runs them all (an engine process each would re-import vLLM-Omni)."""
    got = {}
    for key, spec in specs.items():
        try:
            with env.context():
                out, shapes = _load_and_run(env.od_config, spec, model_dir)
        except Exception as exc:
            raise RuntimeError(f"TP={world} rank {rank}, spec {key!r}: {spec}") from exc
        got[key] = out.numpy().copy(), shapes
    return got


def _load_and_run(od, spec, model_dir: str):
    """This rank's expert, built and loaded by vLLM-Omni, run once: (output, block 0's parameter shapes)."""
    if spec.get("backend") == "npu":
        from tests.support.fake_torch_npu import fake_torch_npu_installed

        # The semantic fake, installed once the engine's platform is resolved; removed afterwards.
        with fake_torch_npu_installed():
            return _build_and_run(od, spec, model_dir)
    return _build_and_run(od, spec, model_dir)


def _build_and_run(od, spec, model_dir: str):
    from vllm.config import LoadConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader
    from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2 import (
        create_transformer_from_config,
        load_transformer_config,
    )
    from vllm_omni.quantization import build_quant_config

    cfg = load_transformer_config(model_dir, "transformer")
    model = create_transformer_from_config(cfg, build_quant_config(spec), component="transformer")
    model.weights_sources = [DiffusersPipelineLoader.ComponentSource(model_dir, "transformer", None)]
    loader = DiffusersPipelineLoader(LoadConfig(), od)
    loader.load_weights(model)
    loader._process_weights_after_loading(model, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(1, 16, 3, 8, 8, generator=g)
    ehs = torch.randn(1, 16, 32, generator=g)
    with torch.no_grad():
        out = model(
            hidden_states=hs, timestep=torch.tensor([500]), encoder_hidden_states=ehs, return_dict=False
        )[0]
    return out, {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith("blocks.0.")}


OCP = {"method": "mxfp4", "backend": "emulated"}
# W4A8 rounds each rank's partial output to bf16 (the NPU mixed kernel's output dtype) before the
# all-reduce, where TP=1 rounds the full sum once.
UOS_W4A8 = {
    "method": "mxfp4",
    "w4a8_fallback_layers": ["blocks.1.ffn.net_2"],
    "mxfp4_scale_alg": 2,
    "backend": "emulated",
}
# The NPU backend over the semantic fake of torch_npu: its kernels write the caller's dtype (float32
# here) after float32 accumulation, so TP=2 sums the same partials.
NPU_FAKE = {"method": "mxfp4", "backend": "npu"}
DUALSCALE = {"method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0, "backend": "emulated"}
# Each world size runs its specs in one set of rank processes; TP=1 is the emulated reference of
# each (NPU_FAKE's is OCP's). The fake NPU runs last in its processes.
RUNS = {
    1: {"ocp": OCP, "uos_w4a8": UOS_W4A8, "dualscale": DUALSCALE},
    2: {"ocp": OCP, "uos_w4a8": UOS_W4A8, "dualscale": DUALSCALE, "npu_fake": NPU_FAKE},
    4: {"dualscale": DUALSCALE},
}
TP1_REFERENCE = {"ocp": "ocp", "uos_w4a8": "uos_w4a8", "npu_fake": "ocp", "dualscale": "dualscale"}


@pytest.fixture(scope="module")
def runs(tiny_dir) -> dict:
    """world -> spec key -> rank -> (output, block 0's shapes), the ranks of a world run once."""
    got = {}
    for world, specs in RUNS.items():
        by_rank = run_ranks(world, _rank_runs, specs, str(tiny_dir))
        got[world] = {
            key: {rank: (torch.from_numpy(r[key][0]), r[key][1]) for rank, r in by_rank.items()}
            for key in specs
        }
    return got


def _tp1(runs: dict, key: str) -> torch.Tensor:
    return runs[1][TP1_REFERENCE[key]][0][0]


@pytest.mark.parametrize(
    "key,tol", [("ocp", 1e-4), ("uos_w4a8", 2e-3), ("npu_fake", 1e-4)], ids=["ocp", "uos_w4a8", "npu_fake"]
)
def test_tp2_equals_tp1(runs, key, tol):
    tp1, tp2 = _tp1(runs, key), runs[2][key]
    out0, shapes0 = tp2[0]
    out1, _ = tp2[1]
    assert torch.equal(out0, out1)  # both ranks hold the full output
    assert shapes0["blocks.0.attn1.to_qkv.weight"] == (768, 256)  # column: half of 3 x 512 rows, packed K
    assert shapes0["blocks.0.ffn.net_2.weight"] == (512, 256)  # row: half of K=1024, packed
    assert shapes0["blocks.0.ffn.net_2.weight_scale"] == (512, 16)
    assert torch.allclose(out0, tp1, rtol=tol, atol=tol), (out0 - tp1).abs().max()


@pytest.mark.parametrize("world", [2, 4])
def test_dualscale_with_unaligned_row_shards_equals_tp1(runs, world):
    tp1, tp = _tp1(runs, "dualscale"), runs[world]["dualscale"]
    out0, shapes0 = tp[0]
    assert all(torch.equal(out0, tp[r][0]) for r in tp)  # every rank holds the full output
    # attn1.to_out has K=512: 512/TP per rank, inside one 512-chunk (TP=4: ranks 1 and 2 pad 128+256 and
    # 256+128). Each rank keeps the chunk's coarse scale, pads its K, and the ranks agree on the chunk's
    # activation maximum, so every rank quantizes its activations exactly as TP=1 does
    # (tests/omni/test_tensor_parallel.py checks that bit for bit); what remains is each rank's bf16
    # partial output (the dual-level GEMM's output dtype) before the all-reduce.
    assert shapes0["blocks.0.attn1.to_out.weight"] == (512, 256 // world)
    assert shapes0["blocks.0.attn1.to_out.weight_dual_scale"] == (512, 1, 1)
    cos = torch.nn.functional.cosine_similarity(out0.flatten(), tp1.flatten(), dim=0).item()
    err = ((out0 - tp1).abs().max() / tp1.abs().max()).item()
    assert cos > 0.99999 and err < 1e-2, (cos, err)
