"""msModelSlim's shipped Qwen-Image-Edit recipe (``qwen-image-edit-w4a4f4-mxfp.yaml``: DualScale W4A4
with ``img_mod.1``/``txt_mod.1``/``txt_mlp.net.2`` excluded, online Q/K rotation, FA3 MXFP4), run
unedited with the real msModelSlim on a tiny Qwen-Image-Edit-2509 pipeline on the CPU
(``tests/support/qwen_image.py``), merged with ``--model-type auto``, loaded by vLLM-Omni's own
Qwen-Image transformer and loader, and compared with msModelSlim's own quantized model (issue #15).

The expected names are written by hand from vLLM-Omni 0.30's ``qwen_image_transformer.py`` (which
Linears it builds with ``quant_config=None``, its fused ``to_qkv`` / ``add_kv_proj``) and the recipe.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.support import msmodelslim_hw_rules as hw
from tests.support import msmodelslim_sd, qwen_image
from tests.support.metrics import cosine
from vllm_omni_mxfp4.checkpoint import CheckpointError, merge

from ..formats.reference import CODE_VALUES
from .edits import edit

pytest.importorskip("msmodelslim")
pytest.importorskip("vllm_omni")

E2M1 = torch.tensor(CODE_VALUES, dtype=torch.float64)
BLOCKS = range(qwen_image.TINY["num_layers"])
QUANTIZED = ("attn.to_qkv", "attn.add_kv_proj", "attn.to_out", "attn.to_add_out")
QUANTIZED += ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj")
# The recipe's exclusions that vLLM-Omni quantizes (txt_mlp.net.2) or never does (img_mod.1, txt_mod.1),
# and the Linears outside the blocks (built with quant_config=None).
IGNORED = sorted(
    [f"transformer_blocks.{i}.{name}" for i in BLOCKS for name in ("img_mod.1", "txt_mlp.net.2", "txt_mod.1")]
    + ["img_in", "txt_in", "norm_out.linear", "proj_out"]
    + [f"time_text_embed.timestep_embedder.linear_{i}" for i in (1, 2)]
)
ATTENTIONS = [f"transformer_blocks.{i}.attn" for i in BLOCKS]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """The tiny pipeline, msModelSlim's export of it, msModelSlim's quantized model (reference output
    and Linears) and the merge's output and report."""
    root = tmp_path_factory.mktemp("qwen_recipe")
    original, export, merged = root / "original", root / "export", root / "merged"
    qwen_image.build_pipeline(original)
    model = qwen_image.run_recipe(original, export)
    reference = qwen_image.reference_forward(model)
    modules = qwen_image.quantized_linears(model)
    linears = {name: msmodelslim_sd.deployed_weight(module) for name, module in modules.items()}
    report = merge("auto", original, export, merged)
    return dict(
        original=original,
        export=export,
        merged=merged,
        reference=reference,
        linears=linears,
        modules=modules,
        report=report,
    )


def _merged(directory):
    tensors = {}
    for path in sorted((directory / "transformer").glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors, json.loads((directory / "transformer" / "config.json").read_text())


def _decode(tensors, layer: str) -> torch.Tensor:
    """A merged DualScale layer's weight as numbers (written independently of the package): E2M1 codes,
    even element in the low nibble, times 2^(E8M0 - 127) per 32, times the float32 scale per 512."""
    packed = tensors[f"{layer}.weight"]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    scale = torch.exp2(tensors[f"{layer}.weight_scale"].double() - 127).repeat_interleave(32, dim=1)
    dual = tensors[f"{layer}.weight_dual_scale"].double().reshape(packed.shape[0], -1)
    return E2M1[codes] * scale * dual.repeat_interleave(512, dim=1)[:, : codes.shape[1]]


def test_auto_merge_config_and_report(recipe):
    tensors, config = _merged(recipe["merged"])
    quant = config["quantization_config"]
    (report,) = recipe["report"].transformers
    assert recipe["report"].model_type == "Qwen-Image-Edit-2509"
    assert (quant["quant_method"], quant["is_checkpoint_serialized"]) == ("mxfp4_dualscale", True)
    assert sorted(quant["ignored_layers"]) == IGNORED
    assert quant["online_rotation"]["layers"] == ATTENTIONS and quant["online_rotation"]["applied"] is False
    assert report.fa3_attention == {attention: "MXFP4_DYNAMIC" for attention in ATTENTIONS}
    assert not [name for name in tensors if name.endswith("_rot") or name.endswith("quant_type")]
    quantized = [name[: -len(".weight_scale")] for name in tensors if name.endswith(".weight_scale")]
    assert len(quantized) == report.layers_quantized == 22  # 11 Linears per block: Q/K/V counted apart
    for layer in quantized:  # no Smooth step in the recipe: DualScale's required mul_scale is the identity
        assert torch.equal(tensors[f"{layer}.mul_scale"], torch.ones(tensors[f"{layer}.mul_scale"].shape))


def test_every_quantized_weight_decodes_to_msmodelslims(recipe):
    tensors, _ = _merged(recipe["merged"])
    linears = recipe["linears"]
    assert len(linears) == 22
    for layer, weight in linears.items():
        # msModelSlim dequantizes in float32: the exact product, rounded once to float32
        assert weight.dtype == torch.float32
        assert torch.equal(_decode(tensors, layer).to(torch.float32), weight), layer


def test_vllm_omni_serves_it_close_to_msmodelslims_model(recipe, vllm_env):
    from vllm_omni_mxfp4.omni.linear import MxLinearMethod

    model = qwen_image.build_engine_transformer(vllm_env, recipe["merged"])
    running = sorted(
        n for n, m in model.named_modules() if isinstance(getattr(m, "quant_method", None), MxLinearMethod)
    )
    assert running == sorted(f"transformer_blocks.{i}.{name}" for i in BLOCKS for name in QUANTIZED)
    ours = qwen_image.engine_forward(vllm_env, model)
    bf16 = qwen_image.engine_forward(
        vllm_env, qwen_image.build_engine_transformer(vllm_env, recipe["original"])
    )
    reference = recipe["reference"]
    # msModelSlim simulates activations with its own exponent rule (floor(log2(amax * 8/7)) - 2) and
    # rounds halves away from zero; the runtime applies the OCP rules. Measured: cosine 0.9906 to
    # msModelSlim's output, 0.9858 to BF16's; msModelSlim's own output is 0.9866 from BF16's.
    assert cosine(ours, reference) > 0.99
    assert cosine(ours, reference) > cosine(bf16, reference)


# vLLM-Omni runtime Linear (suffix inside a block) -> the diffusers Linears msModelSlim quantized.
RUNTIME_TO_ORIGINAL = {
    "attn.to_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "attn.add_kv_proj": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "attn.to_out": ("attn.to_out.0",),
    "attn.to_add_out": ("attn.to_add_out",),
    "img_mlp.net.0.proj": ("img_mlp.net.0.proj",),
    "img_mlp.net.2": ("img_mlp.net.2",),
    "txt_mlp.net.0.proj": ("txt_mlp.net.0.proj",),
}


def _originals(runtime: str) -> list[str]:
    """The diffusers Linears that make up one vLLM-Omni runtime Linear (``transformer_blocks.N....``)."""
    block, suffix = ".".join(runtime.split(".")[:2]), runtime.split(".", 2)[2]
    return [f"{block}.{name}" for name in RUNTIME_TO_ORIGINAL[suffix]]


def test_vllm_omni_equals_msmodelslims_linears_with_hardware_rules(recipe, vllm_env):
    """vLLM-Omni's transformer from the BF16 original with msModelSlim's own DualScale Linears installed
    (same attention, vLLM-Omni's, on both sides), those Linears' activation quantization replaced by the
    dual-level kernel's rule (tests/support/msmodelslim_hw_rules.py), against the merged checkpoint on
    vLLM-Omni. Both multiply the same float32 operands (the DualScale activations carry a float32 coarse
    scale, so they are not BF16-exact, but each is one float32 rounding of the same exact product) in
    float32 and round the result to BF16: float32 accumulation order can flip that rounding by one step.
    So: each Linear at most one BF16 step away, almost all equal; the transformer within one BF16 step
    at the output's scale. Measured: every Linear and the transformer output bit-identical.

    The same model with msModelSlim's Linears unpatched (its own rules, under its adapter's bf16
    autocast) is at cosine 0.9901 from ours and 0.9929 from msModelSlim's diffusers model (the
    attention implementations differ), which ``test_vllm_omni_serves_it_close_to_msmodelslims_model``
    compares with."""
    ours = qwen_image.build_engine_transformer(vllm_env, recipe["merged"])
    layers = {n: m for n, m in ours.named_modules() if n.split(".", 2)[-1] in RUNTIME_TO_ORIGINAL}
    assert len(layers) == len(QUANTIZED) * len(BLOCKS)
    seen = hw.capture(layers)
    got = qwen_image.engine_forward(vllm_env, ours)
    model = qwen_image.build_engine_transformer(vllm_env, recipe["original"])
    modules = recipe["modules"]
    hw.install(model, {n: [modules[o] for o in _originals(n)] for n in layers})
    with hw.hardware_activations(list(modules.values())):
        hardware = qwen_image.engine_forward(vllm_env, model)
        with vllm_env.context(), torch.no_grad():
            steps = {
                n: hw.bf16_steps(out, hw.first(model.get_submodule(n)(x))) for n, (x, out) in seen.items()
            }
    hw.assert_within_accumulation(steps, got, hardware)


def _copy(recipe, tmp_path):
    original, export = tmp_path / "original", tmp_path / "export"
    shutil.copytree(recipe["original"], original)
    shutil.copytree(recipe["export"], export)
    return original, export


def _kept_bf16(layer: str):
    """The export with ``layer`` stored as FLOAT (its original weight and bias, no scales)."""

    def mutate(tensors, entries):
        for leaf in ("weight", "weight_scale", "weight_dual_scale", "bias"):
            tensors.pop(f"{layer}.{leaf}", None)
            entries.pop(f"{layer}.{leaf}", None)

    return mutate


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            "to_k_bf16",
            r"fused transformer_blocks\.1\.attn\.to_qkv \(export transformer_blocks\.1\.attn\): partial BF16 "
            r"fallback \(to_q, to_v quantized, to_k BF16\); vLLM-Omni fuses to_q, to_k, to_v into "
            r"transformer_blocks\.1\.attn\.to_qkv",
        ),
        (
            "quantized_img_mod",
            r"layer transformer_blocks\.0\.img_mod\.1 \(export transformer_blocks\.0\.img_mod\.1\): is quantized, "
            r"but vLLM-Omni runs this Linear in BF16 \(its QwenImageTransformer2DModel builds it without a "
            r"quantization config\)",
        ),
        (
            "k_rot_on_a_linear",
            r"rotation record 'transformer_blocks\.0\.img_mlp\.net\.2\.k_rot' is a k_rot on no attention",
        ),
    ],
)
def test_what_vllm_omni_cannot_serve_is_refused(recipe, tmp_path, change, message):
    original, export = _copy(recipe, tmp_path)
    state = load_file(str(original / "transformer" / "diffusion_pytorch_model.safetensors"))

    def mutate(tensors, entries):
        if change == "to_k_bf16":
            _kept_bf16("transformer_blocks.1.attn.to_k")(tensors, entries)
            for leaf in ("weight", "bias"):
                name = f"transformer_blocks.1.attn.to_k.{leaf}"
                tensors[name], entries[name] = state[name], "FLOAT"
        elif change == "quantized_img_mod":  # DualScale tensors of the right shapes; F32 bias
            for leaf in ("weight", "weight_scale", "weight_dual_scale"):
                name = f"transformer_blocks.0.img_mod.1.{leaf}"
                tensors[name], entries[name] = _requantized(state, leaf), "W4A4_MXFP4_DUALSCALE"
            bias = "transformer_blocks.0.img_mod.1.bias"
            tensors[bias] = tensors[bias].float()
        else:
            name = "transformer_blocks.0.img_mlp.net.2.k_rot"
            tensors[name], entries[name] = tensors["transformer_blocks.0.k_rot"].clone(), "FLOAT"

    edit(export, mutate)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=message):
        merge("auto", original, export, out)
    assert not out.exists()


def _requantized(state, leaf: str) -> torch.Tensor:
    """DualScale tensors of the right shapes for img_mod.1 (values of a valid DualScale layer)."""
    n, k = state["transformer_blocks.0.img_mod.1.weight"].shape
    if leaf == "weight":
        return torch.full((n, k // 2), 0x22, dtype=torch.uint8)
    if leaf == "weight_scale":
        return torch.full((n, k // 32), 127, dtype=torch.uint8)
    return torch.ones((n, -(-k // 512), 1), dtype=torch.float32)


def test_cli_json_stdout_is_only_the_report(recipe, tmp_path, monkeypatch):
    """In a fresh process the merge imports vLLM-Omni to derive the names; vLLM's logs go to stderr.
    An empty cache of its own, so that the names are derived here, not read from the session's."""
    monkeypatch.setenv("VLLM_OMNI_MXFP4_CACHE", str(tmp_path / "cache"))
    argv = [
        sys.executable,
        "-m",
        "vllm_omni_mxfp4.cli",
        "merge",
        "--model-type",
        "auto",
        "--dry-run",
        "--json",
    ]
    argv += ["--original-model", str(recipe["original"]), "--quant-path", str(recipe["export"])]
    argv += ["--output-path", str(tmp_path / "out")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert (report["model_type"], report["transformers"][0]["layers_quantized"]) == (
        "Qwen-Image-Edit-2509",
        22,
    )
