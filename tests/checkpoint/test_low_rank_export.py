"""msModelSlim's ``svd_res`` exports (``W4A4_MXFP4_SVD``, ``W4A4_MXFP4_DUALSCALE_SVD``): merged, served and
proven against msModelSlim's own model (issue #26).

``svd_export`` is a real msModelSlim run on the tiny two-expert Wan2.2: its ``svd_res`` processor, then
Smooth and the quantizer, saved by the ascendv1 saver (transformer: single-scale, rank 16;
transformer_2: DualScale, rank 8; see ``SVD_SPECS`` in conftest.py). The proof follows
test_recipes_proof.py: vLLM-Omni's transformer built from the BF16 original with msModelSlim's own
deployed modules (``SVDResidualWrapper`` around its fake-quant Linear, which adds
``F.linear(F.linear(x, l1), l2)`` to the residual's output) against the merged checkpoint through
vLLM-Omni's loader, emulated kernels with float32 GEMMs; only msModelSlim's activation rounding is
replaced by the hardware rule (tests/support/msmodelslim_hw_rules.py).

Bad inputs are built from the valid export (merge) or the valid merged checkpoint (load) and refused
by name.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support import msmodelslim_hw_rules as hw
from tests.support.layers import build_expert, env_vars, forward, quantized_layers

from .conftest import EXPERTS, SVD_SPECS
from .edits import assert_refused, drop, relabel, replace

QKV = "blocks.1.self_attn"  # a fused Q/K/V with a pair on each piece in both experts
FFN_DOWN = "blocks.1.ffn.2"  # row-parallel, svd in both experts
BF16_LAYER = "blocks.0.ffn.0"  # FLOAT in transformer (high_noise_model)


_RUNTIME = {o: runtime for runtime, originals in hw.RUNTIME_TO_ORIGINAL.items() for o in originals}


def _merged_tensors(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def _diffusers(name: str) -> str:
    """The diffusers Linear of an original Wan Linear name, for the layers this file uses."""
    block, rest = name.split(".", 2)[1], name.split(".", 2)[2]
    table = {
        "self_attn.q": "attn1.to_q",
        "self_attn.k": "attn1.to_k",
        "self_attn.v": "attn1.to_v",
        "self_attn.o": "attn1.to_out.0",
        "cross_attn.q": "attn2.to_q",
        "cross_attn.k": "attn2.to_k",
        "cross_attn.v": "attn2.to_v",
        "cross_attn.o": "attn2.to_out.0",
        "ffn.0": "ffn.net.0.proj",
        "ffn.2": "ffn.net.2",
    }
    return f"blocks.{block}.{table[rest]}"


@pytest.mark.parametrize("folder", list(EXPERTS))
def test_merge_keeps_each_pair_as_msmodelslim_wrote_it(merged_svd, svd_export, folder):
    out, _ = merged_svd
    references = svd_export.references[folder]
    with_pair = {name: ref for name, ref in references.items() if ref.low_rank is not None}
    assert len(with_pair) >= 10
    tensors = _merged_tensors(out / folder)
    for name, ref in with_pair.items():
        layer = _diffusers(name)
        l1, l2 = tensors[f"{layer}.svd_lowrank_l1"], tensors[f"{layer}.svd_lowrank_l2"]
        assert l1.dtype == l2.dtype == torch.bfloat16
        assert torch.equal(l1, ref.low_rank[0]) and torch.equal(l2, ref.low_rank[1])
    without = [name for name, ref in references.items() if ref.low_rank is None]
    assert without, "each expert keeps plain-quantized Linears beside the svd ones"
    for name in without:
        assert f"{_diffusers(name)}.svd_lowrank_l1" not in tensors
    config = json.loads((out / folder / "config.json").read_text())["quantization_config"]
    ranks = config["svd_lowrank_layers"]
    assert set(ranks.values()) == {SVD_SPECS[folder].svd_rank}
    runtime = {f"{n.split('.')[0]}.{n.split('.')[1]}.{_RUNTIME[n.split('.', 2)[2]]}" for n in with_pair}
    assert sorted(ranks) == sorted(runtime)  # Q, K and V share attn1.to_qkv
    assert f"{QKV.replace('self_attn', 'attn1')}.to_qkv" in ranks
    description = json.loads((out / folder / "quant_model_description.json").read_text())
    layer = _diffusers(FFN_DOWN)
    assert description[f"{layer}.svd_lowrank_l1"] == "FLOAT"
    assert description[f"{layer}.weight"].endswith("_SVD")


def test_merge_summary_names_the_pairs(merged_svd):
    from vllm_omni_mxfp4.cli import format_merge_summary

    summary = format_merge_summary(merged_svd[1])
    assert "low-rank pairs (svd_res): 12 layers, rank 16 (svd_lowrank_layers)" in summary
    assert "low-rank pairs (svd_res): 15 layers, rank 8 (svd_lowrank_layers)" in summary


def _fake_quant(module: torch.nn.Module) -> torch.nn.Module:
    """msModelSlim's fake-quant Linear inside its wrappers."""
    while hasattr(module, "wrapped_module"):
        module = module.wrapped_module
    return module


@pytest.mark.parametrize("folder", list(EXPERTS))
def test_transformer_equals_msmodelslims_model(vllm_env, merged_svd, svd_export, folder):
    """Every quantized Linear (residual plus branch, Smooth where msModelSlim smoothed a layer without a
    pair) and the whole transformer equal msModelSlim's deployed model under the hardware activation
    rule: bit for bit up to float32 accumulation order (the proofs' bound). Measured: every Linear and the
    transformer output bit-identical, for both experts."""
    with env_vars(VLLM_OMNI_MXFP4_EMULATED_COMPUTE="float32"):
        ours = build_expert(vllm_env, merged_svd[0], None, sub=folder)
    layers = quantized_layers(ours)
    with_pair = [n for n, layer in layers.items() if layer._mx.low_rank]
    assert len(with_pair) == len(
        json.loads((merged_svd[0] / folder / "config.json").read_text())["quantization_config"][
            "svd_lowrank_layers"
        ]
    )
    seen = hw.capture(layers)
    got = forward(vllm_env, ours)
    reference = build_expert(vllm_env, svd_export.original, None, sub=folder)
    deployed = {name: ref.module for name, ref in svd_export.references[folder].items()}
    installed = hw.msmodelslim_layers(reference, deployed)
    assert sorted(installed) == sorted(layers)
    hw.install(reference, installed)
    with hw.hardware_activations([_fake_quant(m) for m in deployed.values()]):
        hardware = forward(vllm_env, reference)
        with vllm_env.context(), torch.no_grad():
            per_layer = {
                n: hw.bf16_steps(out, hw.first(reference.get_submodule(n)(x))) for n, (x, out) in seen.items()
            }
    hw.assert_within_accumulation(per_layer, got, hardware)
    # the branch matters: without it the same residuals are far from msModelSlim's model
    for name in with_pair:
        layers[name]._mx.low_rank = 0
    without = forward(vllm_env, ours)
    assert (without - hardware).abs().max() > 100 * (got - hardware).abs().max()


# Bad inputs at merge (edits of the real export) --------------------------------------------------


def _pad_rank(extra: int):
    def mutate(tensors, entries):
        l1, l2 = tensors[f"{FFN_DOWN}.svd_lowrank_l1"], tensors[f"{FFN_DOWN}.svd_lowrank_l2"]
        tensors[f"{FFN_DOWN}.svd_lowrank_l1"] = torch.cat([l1, l1[:1].repeat(extra, 1)])
        tensors[f"{FFN_DOWN}.svd_lowrank_l2"] = torch.cat(
            [l2, torch.zeros(l2.shape[0], extra, dtype=l2.dtype)], 1
        )

    return mutate


def _smooth_with_pair(nesting: str):
    """The names msModelSlim writes for a Linear wrapped by svd_res and a non-fusion Smooth: SVD outside
    (``X.svd_lowrank_l1``, ``X.div.mul_scale``, ``X.linear.weight``) or Smooth outside
    (``X.div.mul_scale``, ``X.linear.svd_lowrank_l1``, ``X.linear.weight``)."""

    def mutate(tensors, entries):
        leaves = ["weight", "weight_scale", "bias"] + (
            ["svd_lowrank_l1", "svd_lowrank_l2"] if nesting == "smooth" else []
        )
        for leaf in leaves:
            tensors[f"{FFN_DOWN}.linear.{leaf}"] = tensors.pop(f"{FFN_DOWN}.{leaf}")
            entries[f"{FFN_DOWN}.linear.{leaf}"] = entries.pop(f"{FFN_DOWN}.{leaf}")
        k = tensors[
            f"{FFN_DOWN}.svd_lowrank_l1" if nesting == "svd" else f"{FFN_DOWN}.linear.svd_lowrank_l1"
        ].shape[1]
        tensors[f"{FFN_DOWN}.div.mul_scale"] = torch.full((k,), 0.5, dtype=torch.bfloat16)
        entries[f"{FFN_DOWN}.div.mul_scale"] = "FLOAT"

    return mutate


def _add_pair(tensors: dict[str, torch.Tensor], layer: str) -> list[str]:
    """A rank-16 BF16 pair of ones for ``layer`` (whose weight holds ``(N, K)``, unpacked); its names."""
    n, k = tensors[f"{layer}.weight"].shape
    tensors[f"{layer}.svd_lowrank_l1"] = torch.ones(16, k, dtype=torch.bfloat16)
    tensors[f"{layer}.svd_lowrank_l2"] = torch.ones(n, 16, dtype=torch.bfloat16)
    return [f"{layer}.svd_lowrank_l1", f"{layer}.svd_lowrank_l2"]


def _add_pair_to(layer: str):
    """An export edit: the pair, labelled FLOAT as msModelSlim labels one."""

    def mutate(tensors, entries):
        for name in _add_pair(tensors, layer):
            entries[name] = "FLOAT"

    return mutate


def _nan_at(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[3, 5] = float("nan")
    return t


MERGE_REFUSALS = {
    "wrong pair shape": (
        replace(f"{FFN_DOWN}.svd_lowrank_l2", lambda t: t[:, :15]),
        rf"svd_lowrank_l2 '{FFN_DOWN}\.svd_lowrank_l2' has shape \[512, 15\]; expected \[512, 16\] \(N, 16\)",
    ),
    "NaN in a pair": (
        replace(f"{FFN_DOWN}.svd_lowrank_l1", _nan_at),
        rf"svd_lowrank_l1 '{FFN_DOWN}\.svd_lowrank_l1' holds nan at \[3, 5\]; expected finite values",
    ),
    "pair on a BF16 layer": (
        _add_pair_to(BF16_LAYER),
        rf"layer {_diffusers(BF16_LAYER)} \(export {BF16_LAYER}\): kept in BF16 \(its weight is labelled FLOAT\) "
        r"but carries a low-rank pair",
    ),
    "rank above min(N, K)": (
        _pad_rank(512 - 16 + 1),
        rf"'{FFN_DOWN}\.svd_lowrank_l1' has rank 513, above min\(N, K\) = 512",
    ),
    "SVD label without its pair": (
        drop(f"{FFN_DOWN}.svd_lowrank_l1", f"{FFN_DOWN}.svd_lowrank_l2"),
        r"labelled W4A4_MXFP4_SVD \(a residual next to a low-rank pair\), but .*svd_lowrank_l1/svd_lowrank_l2 are missing",
    ),
    "pair under a plain label": (
        lambda t, e: [
            relabel(f"{FFN_DOWN}.{leaf}", "W4A4_MXFP4")(t, e) for leaf in ("weight", "weight_scale")
        ],
        r"carries a low-rank pair but is labelled W4A4_MXFP4; msModelSlim labels a Linear with a pair W4A4_MXFP4_SVD",
    ),
    "Smooth inside the SVD wrapper": (
        _smooth_with_pair("svd"),
        r"carries a low-rank pair and a Smooth scale \(blocks\.1\.ffn\.2\.div\.mul_scale\)",
    ),
    "SVD inside the Smooth wrapper": (
        _smooth_with_pair("smooth"),
        r"carries a low-rank pair and a Smooth scale \(blocks\.1\.ffn\.2\.div\.mul_scale\)",
    ),
    "fused pieces of different ranks": (
        lambda t, e: [
            replace(f"{QKV}.k.svd_lowrank_l1", lambda x: x[:8])(t, e),
            replace(f"{QKV}.k.svd_lowrank_l2", lambda x: x[:, :8])(t, e),
        ],
        r"fused blocks\.1\.attn1\.to_qkv .*: to_q/to_k/to_v have low-rank pairs of different ranks "
        r"\(to_q rank 16, to_k rank 8, to_v rank 16\)",
    ),
    "an MXFP8 Linear with a pair": (
        lambda t, e: [
            relabel(f"{FFN_DOWN}.{leaf}", "W8A8_MXFP8_SVD")(t, e) for leaf in ("weight", "weight_scale")
        ],
        r"is labelled W8A8_MXFP8_SVD, a W8A8 MXFP8 Linear with an svd_res low-rank pair",
    ),
}


@pytest.mark.parametrize("case", list(MERGE_REFUSALS))
def test_merge_refuses(svd_copy, tmp_path, case):
    mutate, message = MERGE_REFUSALS[case]
    assert_refused(svd_copy, tmp_path, message, mutate)


# Bad inputs at load and in ``inspect`` (edits of the valid merged checkpoint) ----------------------

DOWN = "blocks.1.ffn.net_2"  # the runtime Linear of FFN_DOWN; its checkpoint tensors are blocks.1.ffn.net.2.*


def _edit_tensor(name: str, value):
    def mutate(tensors, ranks):
        tensors[name] = value(tensors[name]).contiguous()

    return mutate


def _pair_on(layer: str):
    """A merged-checkpoint edit: the pair, and no svd_lowrank_layers entry for it."""

    def mutate(tensors, ranks):
        _add_pair(tensors, layer)

    return mutate


def _rank(layer: str, rank: int):
    def mutate(tensors, ranks):
        ranks[layer] = rank

    return mutate


#: case -> (edit of the merged transformer, what the loader says, what inspect says)
LOAD_REFUSALS = {
    "NaN in a pair": (
        _edit_tensor("blocks.1.ffn.net.2.svd_lowrank_l1", _nan_at),
        rf"{DOWN}\.svd_lowrank_l1: 1 of 16384 values break the rule 'finite'",
        r"blocks\.1\.ffn\.net\.2\.svd_lowrank_l1: holds nan at \[3, 5\]; expected finite values",
    ),
    "wrong pair shape": (
        _edit_tensor("blocks.1.ffn.net.2.svd_lowrank_l2", lambda t: t[:, :15]),
        rf"{DOWN}\.svd_lowrank_l2: has shape \[512, 15\]; expected \[512, 16\] \(N, 16\)",
        r"blocks\.1\.ffn\.net\.2\.svd_lowrank_l2: has shape \[512, 15\]; expected \[512, 16\]",
    ),
    "pair on a BF16 layer": (
        _pair_on("blocks.0.ffn.net.2"),
        r"blocks\.0\.ffn\.net\.2\.svd_lowrank_l[12]: the checkpoint stores a low-rank pair .* that the "
        r"quantization_config does not list in svd_lowrank_layers",
        r"blocks\.0\.ffn\.net\.2\.svd_lowrank_l1: a svd_lowrank_l1 tensor for a Linear that loads a BF16 weight",
    ),
    "rank above min(N, K)": (
        _rank(DOWN, 600),
        rf"{DOWN}: svd_lowrank_layers gives rank 600, which exceeds min\(N, K\) = 512",
        rf"building WanTransformer3DModel from config\.json failed \(ValueError: {DOWN}: svd_lowrank_layers gives rank "
        r"600, which exceeds min\(N, K\) = 512",
    ),
    "listed without a pair": (
        _rank("blocks.2.attn2.to_q", 16),
        r"blocks\.2\.attn2\.to_q\.svd_lowrank_l1: required by offline mxfp4 \(svd_lowrank_layers lists the layer\) "
        r"but missing from the checkpoint",
        r"blocks\.2\.attn2\.to_q\.svd_lowrank_l1: missing; an offline mxfp4 Linear loads",
    ),
}


def _broken(merged, tmp_path, mutate):
    """A copy of the merged pipeline with ``mutate(tensors, svd_lowrank_layers)`` applied to transformer."""
    out = tmp_path / "merged"
    shutil.copytree(merged, out)
    folder = out / "transformer"
    (shard,) = folder.glob("*.safetensors")
    tensors = load_file(str(shard))
    config = json.loads((folder / "config.json").read_text())
    mutate(tensors, config["quantization_config"]["svd_lowrank_layers"])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.mark.parametrize("case", list(LOAD_REFUSALS))
def test_load_refuses(vllm_env, merged_svd, tmp_path, case):
    mutate, message, _ = LOAD_REFUSALS[case]
    broken = _broken(merged_svd[0], tmp_path, mutate)
    with pytest.raises(ValueError, match=message):
        build_expert(vllm_env, broken, None)


@pytest.mark.parametrize("case", list(LOAD_REFUSALS))
def test_inspect_names(merged_svd, tmp_path, case):
    from vllm_omni_mxfp4.inspection import inspect_path

    mutate, _, message = LOAD_REFUSALS[case]
    report = inspect_path(_broken(merged_svd[0], tmp_path, mutate), component="transformer")
    assert any(re.search(message, p) for p in report.problems), report.problems


def test_inspect_shows_each_pair(merged_svd):
    from vllm_omni_mxfp4.inspection import format_table, inspect_path

    report = inspect_path(merged_svd[0], component="transformer_2")
    assert report.ok, report.problems
    table = format_table(report)
    assert "svd_lowrank_l1 BF16 [8, 512] x3, svd_lowrank_l2 BF16 [512, 8] x3" in table  # fused Q/K/V
    assert "svd_lowrank_layers: {" in table


# Tensor parallelism ---------------------------------------------------------------------------------


def _tp_rank(rank: int, world: int, env, model_dir: str) -> dict:
    """On one TP rank: each expert of the merged checkpoint, auto-detected from its config.json, built and
    loaded by vLLM-Omni (float32), run once; its output and its pair shapes (numpy / plain Python)."""
    from vllm.config import LoadConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader
    from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2 import (
        create_transformer_from_config,
        load_transformer_config,
    )

    got = {}
    for sub in EXPERTS:
        with env.context():
            cfg = load_transformer_config(model_dir, sub)
            model = create_transformer_from_config(cfg, None, component=sub)
            model.weights_sources = [DiffusersPipelineLoader.ComponentSource(model_dir, sub, None)]
            loader = DiffusersPipelineLoader(LoadConfig(), env.od_config)
            loader.load_weights(model)
            loader._process_weights_after_loading(model, torch.device("cpu"))
            g = torch.Generator().manual_seed(0)
            hs, ehs = torch.randn(1, 16, 3, 8, 8, generator=g), torch.randn(1, 16, 32, generator=g)
            # TP=1 also runs the input with one bf16 rounding's worth of noise: how far the model moves then
            inputs = [hs] if world > 1 else [hs, hs * (1 + 2.0**-9 * torch.randn(hs.shape, generator=g))]
            with torch.no_grad():
                outs = [
                    model(
                        hidden_states=h,
                        timestep=torch.tensor([500]),
                        encoder_hidden_states=ehs,
                        return_dict=False,
                    )[0]
                    for h in inputs
                ]
        shapes = {
            n: tuple(p.shape)
            for n, p in model.named_parameters()
            if "svd_lowrank" in n and n.startswith("blocks.1.")
        }
        got[sub] = [o.numpy().copy() for o in outs], shapes
    return got


def _distance(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |diff| / max |want|, 1 - cosine)."""
    err = ((got - want).abs().max() / want.abs().max()).item()
    return err, 1 - torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()


@pytest.mark.slow
def test_tp2_equals_tp1(merged_svd):
    """Column-parallel ranks keep their output rows of L2, row-parallel ranks their K columns of L1 (the
    branch's partial sums join the all-reduce). Single scale: TP=2 equals TP=1 up to float32 summation
    order. DualScale: each rank rounds its partial output to bf16 (the dual-level GEMM's output dtype),
    and this random-weight W4A4 model moves as far when its input gets one bf16 rounding's worth of
    noise (measured: 8.8 % max, 1 - cosine 2.2e-3); TP=2 stays within twice that."""
    from tests.support.tp_ranks import run_ranks

    tp1 = run_ranks(1, _tp_rank, str(merged_svd[0]))[0]
    tp2 = run_ranks(2, _tp_rank, str(merged_svd[0]))
    for sub, rank in (("transformer", 16), ("transformer_2", 8)):
        (out0,), shapes = tp2[0][sub]
        assert (out0 == tp2[1][sub][0][0]).all()
        assert shapes["blocks.1.attn1.to_qkv.svd_lowrank_l1"] == (3 * rank, 512)  # column: every K
        assert shapes["blocks.1.attn1.to_qkv.svd_lowrank_l2"] == (768, rank)  # column: half the rows
        assert shapes["blocks.1.ffn.net_2.svd_lowrank_l1"] == (rank, 512)  # row: half of K = 1024
        assert shapes["blocks.1.ffn.net_2.svd_lowrank_l2"] == (512, rank)
        want, noisy = (torch.from_numpy(o) for o in tp1[sub][0])
        err, cos_gap = _distance(torch.from_numpy(out0), want)
        if sub == "transformer":
            assert err < 1e-4, err
        else:
            noise_err, noise_gap = _distance(noisy, want)
            assert err <= 2 * noise_err and cos_gap <= 2 * noise_gap, (err, cos_gap, noise_err, noise_gap)


def test_npu_kernels_run_the_stored_pair(vllm_env, merged_svd):
    """The branch runs outside the kernel: on the NPU kernels (through the semantic fake of torch_npu)
    the merged checkpoint gives what the emulated kernels with float32 GEMMs give, pairs included."""
    from tests.support.fake_torch_npu import fake_torch_npu_installed

    for folder in EXPERTS:
        with env_vars(VLLM_OMNI_MXFP4_EMULATED_COMPUTE="float32"):
            want = forward(vllm_env, build_expert(vllm_env, merged_svd[0], None, sub=folder))
        with fake_torch_npu_installed(), env_vars(VLLM_OMNI_MXFP4_BACKEND="npu"):
            npu = build_expert(vllm_env, merged_svd[0], None, sub=folder)
            layers = quantized_layers(npu)
            assert {layer._mx.kernel.backend for layer in layers.values()} == {"npu"}
            assert sum(1 for layer in layers.values() if layer._mx.low_rank) >= 12
            got = forward(vllm_env, npu)
        assert torch.equal(got, want), (folder, (got - want).abs().max())


def test_w4a8_layers_keep_the_stored_pair(vllm_env, merged_svd):
    """A runtime W4A8 policy on the merged checkpoint (storage from its config.json, policy from the
    user's): the W4A8 layer keeps its stored pair, and its output is its W4A8 GEMM plus the branch."""
    import torch.nn.functional as F

    from vllm_omni_mxfp4.config import Precision

    spec = {"method": "mxfp4", "w4a8_fallback_layers": [DOWN]}
    model = build_expert(vllm_env, merged_svd[0], spec)
    layer = quantized_layers(model)[DOWN]
    assert layer.quant_method.route.precision is Precision.W4A8 and layer._mx.low_rank == 16
    x = torch.randn(5, layer.input_size_per_partition, generator=torch.Generator().manual_seed(3)).to(
        torch.bfloat16
    )
    with vllm_env.context(), torch.no_grad():
        full = layer.quant_method.forward(layer, x, None)
        layer._mx.low_rank = 0
        main = layer.quant_method.forward(layer, x, None)
        layer._mx.low_rank = 16
    branch = F.linear(F.linear(x, layer.svd_lowrank_l1), layer.svd_lowrank_l2)
    assert torch.equal(full, main + branch)


def test_rocm_kernel_runs_the_stored_pair(vllm_env, merged_svd, monkeypatch):
    """The single-scale expert on the ROCm kernel (fake AITER, RCEIL era) equals the emulated kernel that
    mirrors AITER's rule, pairs included (ROCm runs no DualScale, so transformer_2 is not tried)."""
    from tests.kernels.conftest import install_aiter
    from tests.support.layers import set_kernels
    from vllm_omni_mxfp4.kernels import AiterSingle, EmulatedAiterSingle

    install_aiter(monkeypatch, "rceil")
    model = build_expert(vllm_env, merged_svd[0], None)
    assert sum(1 for layer in quantized_layers(model).values() if layer._mx.low_rank) >= 12
    set_kernels(model, lambda fmt: AiterSingle())
    got = forward(vllm_env, model)
    set_kernels(model, lambda fmt: EmulatedAiterSingle(rule="rceil", compute_dtype="float32"))
    assert torch.equal(got, forward(vllm_env, model))
