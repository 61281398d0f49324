"""msModelSlim's ``flux1`` adapter, run with the real msModelSlim on a tiny FLUX.1-dev pipeline on the
CPU with an MXFP4 config of the user guide's form (single-scale and DualScale) that includes only
what vLLM-Omni's Flux quantizes (``tests/support/flux1_export.py``), merged with ``--model-type
auto``, loaded by vLLM-Omni's own ``FluxTransformer2DModel`` and loader, and compared with msModelSlim's
own quantized model (issue #14).

The expected names are written by hand from vLLM-Omni 0.30's ``flux/flux_transformer.py``: only the
single-stream blocks' ``attn.to_qkv`` (fused ``to_q``/``to_k``/``to_v``), ``proj_mlp`` and
``proj_out`` get the quantization config; the double-stream blocks, ``norm.linear`` and the
embedders are built with ``safe_quant_config`` or as plain ``nn.Linear``.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.support import flux1_export, msmodelslim_sd
from tests.support.metrics import cosine
from vllm_omni_mxfp4.checkpoint import CheckpointError, merge

from .edits import edit

pytest.importorskip("msmodelslim")
pytest.importorskip("vllm_omni")

METHODS = ("mxfp4", "mxfp4_dualscale")
SVD = "mxfp4 svd_res 16"
SINGLE = "single_transformer_blocks.0"
RUNNING = sorted(f"{SINGLE}.{name}" for name in ("attn.to_qkv", "proj_mlp", "proj_out"))
EXPORTED = sorted(
    f"{SINGLE}.{name}" for name in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")
)
_DOUBLE = ("attn.add_kv_proj", "attn.to_add_out", "attn.to_out.0", "attn.to_qkv", "norm1.linear")
_DOUBLE += ("norm1_context.linear", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
_EMBEDDERS = [
    f"time_text_embed.{e}.linear_{i}" for e in ("guidance_embedder", "text_embedder") for i in (1, 2)
]
_EMBEDDERS += [f"time_text_embed.timestep_embedder.linear_{i}" for i in (1, 2)]
IGNORED = sorted(
    [f"transformer_blocks.0.{name}" for name in _DOUBLE]
    + [f"{SINGLE}.norm.linear", "context_embedder", "x_embedder", "norm_out.linear", "proj_out"]
    + _EMBEDDERS
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per method: the tiny pipeline, msModelSlim's export of it, msModelSlim's quantized model
    (reference output and deployed weights) and the merge's output and report; and :data:`SVD`'s
    export, reference output and merge. Both exports are made
    before any test of this module initializes torch.distributed (``vllm_env``): msModelSlim's saver
    writes per-rank folders when it is."""
    found = {}
    for method in METHODS:
        root = tmp_path_factory.mktemp(f"flux1_{method}")
        original, export, merged = root / "original", root / "export", root / "merged"
        flux1_export.build_pipeline(original)
        model = flux1_export.run_recipe(original, export, method)
        linears = msmodelslim_sd.quantized_linears(model)
        found[method] = dict(
            method=method,
            original=original,
            export=export,
            merged=merged,
            reference=flux1_export.reference_forward(model),
            linears={name: msmodelslim_sd.deployed_weight(module) for name, module in linears.items()},
            report=merge("auto", original, export, merged),
        )
    # msModelSlim's svd_res (rank 16) then W4A4 MXFP4 on the same Linears, ascendv1 saver
    root = tmp_path_factory.mktemp("flux1_svd")
    original, export, merged = found["mxfp4"]["original"], root / "export", root / "merged"
    model = flux1_export.run_recipe(original, export, "mxfp4", svd_rank=16)
    found[SVD] = dict(
        merged=merged,
        reference=flux1_export.reference_forward(model),
        report=merge("auto", original, export, merged),
    )
    return found


@pytest.fixture(params=METHODS)
def flux(request, runs):
    return runs[request.param]


def test_auto_merge_config_and_report(flux):
    tensors, config = msmodelslim_sd.merged_transformer(flux["merged"])
    quant = config["quantization_config"]
    (report,) = flux["report"].transformers
    assert flux["report"].model_type == "FLUX.1-dev"
    assert quant["quant_method"] == flux["method"]
    assert sorted(quant["ignored_layers"]) == IGNORED
    quantized = sorted(name[: -len(".weight_scale")] for name in tensors if name.endswith(".weight_scale"))
    assert quantized == EXPORTED and report.layers_quantized == 5
    dual = [name for name in tensors if name.endswith(".weight_dual_scale")]
    assert len(dual) == (5 if flux["method"] == "mxfp4_dualscale" else 0)


def test_every_quantized_weight_decodes_to_msmodelslims(flux):
    tensors, _ = msmodelslim_sd.merged_transformer(flux["merged"])
    linears = flux["linears"]
    assert sorted(linears) == EXPORTED
    # DualScale dequantizes in float32 (the exact product, rounded once); single-scale in the weight's
    # BF16, where every E2M1 value times a power of two in range is exact.
    dtype = torch.float32 if flux["method"] == "mxfp4_dualscale" else torch.bfloat16
    for layer, weight in linears.items():
        assert weight.dtype == dtype
        assert torch.equal(msmodelslim_sd.decode(tensors, layer).to(dtype), weight), layer


def test_vllm_omni_serves_it_close_to_msmodelslims_model(runs, flux, vllm_env):
    model = flux1_export.engine_transformer(vllm_env, flux["merged"])
    assert msmodelslim_sd.running_mx_layers(model) == RUNNING
    ours = flux1_export.engine_forward(vllm_env, model)
    bf16 = flux1_export.engine_forward(vllm_env, flux1_export.engine_transformer(vllm_env, flux["original"]))
    reference = flux["reference"]
    # msModelSlim simulates activations with its own exponent rule and rounding; the runtime applies
    # the OCP rules. Measured: cosine 0.9966 (mxfp4) / 0.9964 (DualScale) to msModelSlim's output,
    # 0.992 to BF16's; msModelSlim's own output is 0.992 / 0.991 from BF16's.
    assert cosine(ours, reference) > 0.99
    assert cosine(ours, reference) > cosine(bf16, reference)


def test_a_quantized_double_stream_linear_is_refused_by_name(runs, tmp_path):
    """A config that also quantizes the double-stream blocks (msModelSlim's ``"*"``) makes Linears
    vLLM-Omni's Flux runs in BF16: refused by name, nothing written (exclude them in the config)."""
    original, export = tmp_path / "original", tmp_path / "export"
    shutil.copytree(runs["mxfp4"]["original"], original)
    shutil.copytree(runs["mxfp4"]["export"], export)
    layer = "transformer_blocks.0.ff.net.2"
    n, k = msmodelslim_sd.merged_transformer(original)[0][f"{layer}.weight"].shape

    def mutate(tensors, entries):  # a valid MXFP4 layer of the right shapes (all codes 2 x 2^0 = 1.0)
        tensors[f"{layer}.weight"] = torch.full((n, k // 2), 0x22, dtype=torch.uint8)
        tensors[f"{layer}.weight_scale"] = torch.full((n, k // 32), 127, dtype=torch.uint8)
        bias = f"{layer}.bias"
        tensors[bias] = tensors[bias].float()  # msModelSlim writes a quantized Linear's bias in F32
        entries[f"{layer}.weight"] = entries[f"{layer}.weight_scale"] = "W4A4_MXFP4"

    edit(export, mutate)
    out = tmp_path / "out"
    message = (
        rf"layer {layer} \(export {layer}\): is quantized, but vLLM-Omni runs this Linear in BF16 \(its "
        r"FluxTransformer2DModel builds it without a quantization config\)"
    )
    with pytest.raises(CheckpointError, match=message):
        merge("auto", original, export, out)
    assert not out.exists()


def test_an_svd_res_export_is_merged_and_served_with_its_pairs(runs, vllm_env):
    """Each quantized Linear keeps its rank-16 pair (fused Q/K/V: one per piece, one rank); served, the
    model is as close to msModelSlim's own (its branch included) as the plain export is (cosine
    0.9966 there), and closer than BF16 is."""
    svd_run = runs[SVD]
    tensors, config = msmodelslim_sd.merged_transformer(svd_run["merged"])
    assert config["quantization_config"]["svd_lowrank_layers"] == dict.fromkeys(RUNNING, 16)
    pairs = sorted(name[: -len(".svd_lowrank_l1")] for name in tensors if name.endswith(".svd_lowrank_l1"))
    assert pairs == EXPORTED
    model = flux1_export.engine_transformer(vllm_env, svd_run["merged"])
    assert msmodelslim_sd.running_mx_layers(model) == RUNNING
    assert all(model.get_submodule(name)._mx.low_rank == 16 for name in RUNNING)
    ours = flux1_export.engine_forward(vllm_env, model)
    bf16 = flux1_export.engine_forward(
        vllm_env, flux1_export.engine_transformer(vllm_env, runs["mxfp4"]["original"])
    )
    assert cosine(ours, svd_run["reference"]) > 0.99
    assert cosine(ours, svd_run["reference"]) > cosine(bf16, svd_run["reference"])
