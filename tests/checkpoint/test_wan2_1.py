"""Wan2.1 T2V (msModelSlim's ``wan2_1`` adapter): a tiny one-transformer ``WanPipeline`` whose
``model_index.json`` is Wan2.1's (no ``transformer_2``, ``boundary_ratio`` or ``expand_timesteps``),
quantized by msModelSlim on the CPU (single-scale and DualScale), merged with ``--model-type auto``,
loaded by vLLM-Omni's own ``WanTransformer3DModel`` and loader (issue #14).

The ``wan2_1`` adapter itself cannot run here: its argument parser, validation and loading all import
the original Wan repository (``wan``, not installed) and build ``wan.WanT2V``. What it quantizes is
that repository's ``WanModel`` (original names ``blocks.N.self_attn.q``, ...), whole, saved at the
export root (``init_model`` returns ``{'': transformer}``, visited by ``attentionblock``): exactly what
the demo's exporter makes with msModelSlim's own quantizer and saver on the original Wan module tree
(``tests/checkpoint/producer.py``), which is what this test runs. The merge is the one Wan2.2's
exports go through; what is new is the model type and its detection.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import layers, msmodelslim_sd
from tests.support.metrics import cosine
from vllm_omni_mxfp4.checkpoint import CheckpointError, merge

from . import producer

pytest.importorskip("msmodelslim")
pytest.importorskip("vllm_omni")

FORMATS = {"mxfp4": "single", "mxfp4_dualscale": "dual"}
BLOCKS = range(producer.TINY["num_layers"])
#: vLLM-Omni's Wan blocks: self-attention Q/K/V fused into attn1.to_qkv, cross-attention Q, K, V apart
#: (written by hand from vllm_omni/diffusion/models/wan2_2/wan2_2_transformer.py).
RUNNING = sorted(
    f"blocks.{i}.{name}"
    for i in BLOCKS
    for name in ("attn1.to_qkv", "attn1.to_out", "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out")
    + ("ffn.net_0.proj", "ffn.net_2")
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny Wan2.1 pipeline and, per method, msModelSlim's export (its dequantized weights by
    original name) and the merge's output and report; all made before ``vllm_env`` initializes
    torch.distributed."""
    root = tmp_path_factory.mktemp("wan2_1")
    original = root / "original"
    states = producer.build_pipeline(original, transformers=("transformer",))
    index = json.loads((original / "model_index.json").read_text())
    for key in ("transformer_2", "boundary_ratio"):
        index.pop(key)
    (original / "model_index.json").write_text(json.dumps(index, indent=2))
    found = {"original": original}
    for method, fmt in FORMATS.items():
        export, merged = root / f"export_{method}", root / f"merged_{method}"
        spec = producer.ExpertSpec(fmt, "mindie", exclude=list(producer.NON_BLOCK_EXCLUDES))
        references = producer.quantize_expert(states["transformer"], export, spec)
        found[method] = dict(
            export=export,
            merged=merged,
            references=references,
            report=merge("auto", original, export, merged),
        )
    return found


@pytest.mark.parametrize("method", FORMATS)
def test_auto_merge_and_every_weight_decodes_to_msmodelslims(runs, method):
    run = runs[method]
    tensors, config = msmodelslim_sd.merged_transformer(run["merged"])
    assert run["report"].model_type == "Wan2.1-T2V"
    assert config["quantization_config"]["quant_method"] == method
    quantized = sorted(name[: -len(".weight_scale")] for name in tensors if name.endswith(".weight_scale"))
    assert len(quantized) == run["report"].transformers[0].layers_quantized == 10 * len(BLOCKS)
    originals = {producer.original_name(f"{layer}.weight")[: -len(".weight")]: layer for layer in quantized}
    assert sorted(originals) == sorted(run["references"])
    for name, layer in originals.items():
        assert torch.equal(msmodelslim_sd.decode(tensors, layer), run["references"][name].values), layer


@pytest.mark.parametrize("method", FORMATS)
def test_vllm_omni_serves_it(runs, method, vllm_env):
    """Built by vLLM-Omni's Wan factory with the quantization config vLLM-Omni builds from the merged
    ``config.json``, loaded by its own loader."""
    merged = runs[method]["merged"]
    quant = msmodelslim_sd.merged_transformer(merged)[1]["quantization_config"]
    model = layers.build_expert(vllm_env, merged, quant)
    assert msmodelslim_sd.running_mx_layers(model) == RUNNING
    ours = layers.forward(vllm_env, model).float()
    bf16 = layers.forward(vllm_env, layers.build_expert(vllm_env, runs["original"], None)).float()
    # Measured: cosine 0.990 (mxfp4) / 0.993 (DualScale) to BF16. The weights are msModelSlim's exactly
    # (the test above); the exporter keeps no whole quantized model to run as an output reference.
    assert cosine(ours, bf16) > 0.98


def test_an_explicit_wan2_2_type_for_a_wan2_1_pipeline_is_refused(runs, tmp_path):
    """Wan2.2-T2V-A14B has two experts; a Wan2.1 pipeline lists one transformer."""
    with pytest.raises(
        CheckpointError, match=r"lists transformers \['transformer'\], but Wan2.2-T2V-A14B has"
    ):
        merge("Wan2.2-T2V-A14B", runs["original"], runs["mxfp4"]["export"], tmp_path / "out", dry_run=True)
