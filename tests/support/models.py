"""Build any vLLM-Omni diffusion transformer from a tiny random config, BF16 and quantized online.

Everything here runs under the ``vllm_env`` fixture (``tests/conftest.py``). A :class:`Case` names
the transformer class, the tiny constructor arguments of its own class and a function that makes
its forward's keyword arguments. :func:`measure` builds the BF16 model with deterministic random
weights, builds the same class with an online quantization spec (weights on the meta device, as our
methods create them), loads the BF16 model's tensors through each parameter's own weight loader
(runtime names: a fused Q/K/V arrives whole and vLLM splits it, as for a fused checkpoint), runs
vLLM-Omni's post-load step, and compares one forward on the same inputs.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import re
import sys
import textwrap
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .metrics import cosine

ROOT = Path(__file__).resolve().parents[2]
TABLE_TOOL = ROOT / "tools" / "model_table.py"

# Online specs of both methods; DualScale keeps no leading block in BF16 (tiny models have 1-2 blocks).
SPECS = {
    "mxfp4": "mxfp4",
    "mxfp4_dualscale": {"quant_method": "mxfp4_dualscale", "num_bf16_fallback_layers": 0},
}


def table_tool():
    """``tools/model_table.py`` as a module (it is a script, not part of a package)."""
    if "model_table" in sys.modules:
        return sys.modules["model_table"]
    spec = importlib.util.spec_from_file_location("model_table", TABLE_TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["model_table"] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def scanned() -> tuple:
    """The table tool's scan of the installed vLLM-Omni (once per test process: it parses every
    model file)."""
    return tuple(table_tool().scan())


@dataclass(frozen=True)
class Case:
    """One transformer: ``key`` as in the model table (``package.Class``), its module, tiny config
    and inputs (``inputs()`` returns the forward's keyword arguments, fixed seed, bf16)."""

    key: str
    module: str
    config: dict
    # None: the model is built and loaded (quantized online) with both methods but its forward is not
    # run; tools/model_table.py's NOTES say why
    inputs: Callable[[], dict] | None
    output: Callable[[object], torch.Tensor] = field(default=lambda out: out[0])
    # the constructor reads its config from od_config.tf_model_config only (no config keywords)
    config_in_od_config_only: bool = False
    # more constructor keywords, made at build time (objects of vLLM-Omni's own config classes)
    extra: Callable[[], dict] | None = None
    # fills what the model's own load_weights computes rather than loads (after construction)
    computed_buffers: Callable[[torch.nn.Module], None] | None = None

    @property
    def cls(self):
        return getattr(importlib.import_module(self.module), self.key.split(".")[1])


def randn(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _fill(name: str, t: torch.Tensor) -> torch.Tensor:
    """A deterministic value for parameter ``name``: weights ~ N(0, 1/K), norms ~ 1, the rest small."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    r = torch.randn(t.shape, generator=g)
    if t.dim() >= 2:
        r = r / t.shape[-1] ** 0.5
    elif "norm" in name and name.endswith("weight"):
        r = 1 + 0.1 * r
    else:
        r = 0.02 * r
    return r.to(t.dtype)


def build(env, case: Case, spec=None):
    """``case``'s transformer, built as vLLM-Omni's pipeline builds it (bf16 default dtype), with the CPU
    platform's op fix-ups installed first, as its general plugin installs them in an engine process."""
    from vllm_omni_mxfp4.omni import build_quant_config
    from vllm_omni_mxfp4.platform.op_fixups import install_op_fixups

    install_op_fixups()
    kwargs = {} if case.config_in_od_config_only else dict(case.config)
    kwargs["quant_config"] = build_quant_config(spec) if spec is not None else None
    kwargs.update(case.extra() if case.extra is not None else {})
    if "od_config" in inspect.signature(case.cls.__init__).parameters:
        from vllm_omni.diffusion.data import TransformerConfig

        # some constructors read the diffusers config from od_config as the pipeline sets it
        env.od_config.tf_model_config = TransformerConfig(params=dict(case.config))
        kwargs["od_config"] = env.od_config
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with env.context():
            model = case.cls(**kwargs)
    finally:
        torch.set_default_dtype(old)
    if case.computed_buffers is not None:
        with torch.no_grad():
            case.computed_buffers(model)
    return model


def randomize(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = _fill(name, p)


def load_from(env, model, source: dict[str, torch.Tensor]) -> None:
    """Load ``source`` (runtime name -> tensor) into ``model`` through each parameter's weight loader, then
    vLLM-Omni's post-load step (which finishes our layers)."""
    with env.context(), torch.no_grad():
        for name, p in list(model.named_parameters()):
            loader = getattr(p, "weight_loader", None)
            if loader is None:
                p.data.copy_(source[name])
            else:
                loader(p, source[name].clone())
    finish(env, model)


def finish(env, model) -> None:
    """vLLM-Omni's post-load step (``process_weights_after_loading`` of every layer), under the bf16
    default dtype the loader runs it with (``DiffusersPipelineLoader.load_model``:
    ``set_default_torch_dtype(od_config.dtype)``): vLLM's CPU Linears replace their packed weight with
    an empty tensor of the default dtype, which models that cast their input to ``weight.dtype`` read."""
    from vllm.config import LoadConfig
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    with env.context(), torch.no_grad(), set_default_torch_dtype(torch.bfloat16):
        DiffusersPipelineLoader(LoadConfig(), env.od_config)._process_weights_after_loading(
            model, torch.device("cpu")
        )
    model.eval()


def forward(env, case: Case, model) -> torch.Tensor:
    with env.context(), torch.no_grad():
        return case.output(model(**case.inputs())).float()


def quantized_names(model) -> list[str]:
    from vllm_omni_mxfp4.omni.linear import MxLinearMethod

    return sorted(
        n for n, m in model.named_modules() if isinstance(getattr(m, "quant_method", None), MxLinearMethod)
    )


def unprepared_names(model) -> list[str]:
    """Quantized Linears not in the ``PREPARED`` phase after loading (quantized, kernel tensors built)."""
    from vllm_omni_mxfp4.omni.state import Phase

    return sorted(n for n in quantized_names(model) if model.get_submodule(n)._mx.phase is not Phase.PREPARED)


def plain_linears(model) -> list[str]:
    """Runtime names of the model's plain ``nn.Linear`` (always BF16)."""
    return sorted(n for n, m in model.named_modules() if type(m) is torch.nn.Linear)


def unquantized_vllm_linears(model) -> list[str]:
    """Runtime names of the vLLM Linears the model built without a quantization config (BF16)."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    return sorted(
        n
        for n, m in model.named_modules()
        if isinstance(m, LinearBase) and isinstance(m.quant_method, UnquantizedLinearMethod)
    )


def fused_linears(model) -> list[str]:
    """Runtime names of the fused Linears (Q/K/V or merged columns: one runtime weight, several
    checkpoint tensors)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    fused = (QKVParallelLinear, MergedColumnParallelLinear)
    return sorted(n for n, m in model.named_modules() if isinstance(m, fused))


def loader_mapping(model) -> dict[str, list[str]]:
    """The model's fused runtime Linears -> the checkpoint names its ``load_weights`` stacks into them:
    its ``stacked_params_mapping`` (an attribute, or the list ``load_weights`` builds, read from its
    source), else its ``packed_modules_mapping``. Names without the dots the mapping's substring
    replacement uses (``".to_qkv."`` -> ``to_qkv``)."""
    stacked = getattr(model, "stacked_params_mapping", None) or _stacked_in_load_weights(type(model))
    if not stacked:
        return {k: list(v) for k, v in getattr(model, "packed_modules_mapping", {}).items()}
    out: dict[str, list[str]] = {}
    for param, shard, _ in stacked:
        out.setdefault(param.strip("."), []).append(shard.strip("."))
    return out


def _stacked_in_load_weights(cls) -> list | None:
    """The literal ``stacked_params_mapping = [...]`` in the nearest ``load_weights`` of ``cls``."""
    for klass in cls.__mro__:
        fn = klass.__dict__.get("load_weights")
        if fn is None:
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
            targets = getattr(node, "targets", [])
            if any(isinstance(t, ast.Name) and t.id == "stacked_params_mapping" for t in targets):
                return ast.literal_eval(node.value)
        return None
    return None


def patterns(names) -> list[str]:
    """Names with block indices folded (``blocks.0.x``, ``blocks.1.x`` -> ``blocks.*.x``), sorted."""
    return sorted({re.sub(r"\.\d+(?=\.|$)", ".*", n) for n in names})


@dataclass
class Measurement:
    quantized: dict[str, list[str]]
    cosine: dict[str, float]
    max_abs: dict[str, float]
    plain: list[str]
    unquantized: list[str]
    fused: list[str]
    packed: dict[str, list[str]]
    # cosine of what the quantized Linears contribute: (quantized - without) vs (BF16 - without),
    # "without" being the BF16 build with those Linears' weights zeroed. The output cosine alone is
    # blind in tiny random models whose residual path dominates the output (a broken quantization
    # still gives 0.9997 on HunyuanVideo-1.5's tiny build); this one is not.
    contribution: dict[str, float] = field(default_factory=dict)
    # quantized Linears whose loading did not end with the kernel's tensors built (should be none)
    unprepared: dict[str, list[str]] = field(default_factory=dict)


def _without(env, case: Case, weights: dict[str, torch.Tensor], linears: list[str]) -> torch.Tensor:
    """The BF16 forward with the weights of ``linears`` zeroed."""
    zeroed = {
        n: torch.zeros_like(w) if n in {f"{name}.weight" for name in linears} else w
        for n, w in weights.items()
    }
    model = build(env, case)
    load_from(env, model, zeroed)
    return forward(env, case, model)


def measure(env, case: Case, methods=tuple(SPECS)) -> Measurement:
    """BF16 vs each online method on one forward of ``case``'s tiny transformer (without a forward
    when ``case.inputs`` is None: what each method quantizes, every quantized layer prepared)."""
    torch.manual_seed(0)
    ref = build(env, case)
    randomize(ref)
    weights = {name: p.detach().clone() for name, p in ref.named_parameters()}
    finish(env, ref)  # vLLM's CPU Linears repack their weights here
    expect = forward(env, case, ref) if case.inputs is not None else None
    packed = loader_mapping(ref)
    out = Measurement({}, {}, {}, plain_linears(ref), [], fused_linears(ref), packed)
    for method in methods:
        model = build(env, case, SPECS[method])
        load_from(env, model, weights)
        out.quantized[method] = quantized_names(model)
        out.unquantized = unquantized_vllm_linears(model)
        out.unprepared[method] = unprepared_names(model)
        if expect is None:
            continue
        got = forward(env, case, model)
        out.cosine[method] = cosine(got, expect)
        out.max_abs[method] = (got - expect).abs().max().item()
        if not out.quantized[method]:
            continue  # nothing quantized contributes: no contribution to compare
        if method == methods[0]:
            base = _without(env, case, weights, out.quantized[method])
        out.contribution[method] = cosine(got - base, expect - base)
    return out


def record(m: Measurement) -> dict:
    """The table's record of a measurement (``tools/model_table.py`` ``MEASURED`` entry)."""
    counts = {len(names) for names in m.quantized.values()}
    assert len(counts) == 1, (
        f"the methods quantize different Linears: { {k: len(v) for k, v in m.quantized.items()} }"
    )
    return {
        "quantized": counts.pop(),
        "plain": patterns(m.plain),
        "unquantized": patterns(m.unquantized),
        "fused": patterns(m.fused),
        "packed": m.packed,
        "cosine": {method: round(value, 5) for method, value in m.cosine.items()},
        "contribution": {method: round(value, 5) for method, value in m.contribution.items()},
        "max_abs": {method: round(value, 5) for method, value in m.max_abs.items()},
    }


# ----------------------------------------------------------------------------- the tiny configs

WAN = Case(
    "wan2_2.WanTransformer3DModel",
    "vllm_omni.diffusion.models.wan2_2.wan2_2_transformer",
    dict(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=1024,
        num_layers=2,
        rope_max_seq_len=64,
    ),
    lambda: dict(
        hidden_states=randn(1, 16, 3, 8, 8, seed=1),
        timestep=torch.tensor([500]),
        encoder_hidden_states=randn(1, 16, 32, seed=2),
        return_dict=False,
    ),
)

QWEN_IMAGE = Case(
    "qwen_image.QwenImageTransformer2DModel",
    "vllm_omni.diffusion.models.qwen_image.qwen_image_transformer",
    dict(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=2,
        attention_head_dim=128,
        num_attention_heads=4,
        joint_attention_dim=64,
        axes_dims_rope=(16, 56, 56),
    ),
    lambda: dict(
        hidden_states=randn(1, 16, 64, seed=1),
        encoder_hidden_states=randn(1, 8, 64, seed=2),
        encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long),
        timestep=torch.tensor([0.5], dtype=torch.bfloat16),
        img_shapes=[[(1, 4, 4)]],
        txt_seq_lens=[8],
        return_dict=False,
    ),
)

FLUX = Case(
    "flux.FluxTransformer2DModel",
    "vllm_omni.diffusion.models.flux.flux_transformer",
    dict(
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=128,
        num_attention_heads=4,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    ),
    lambda: dict(
        hidden_states=randn(1, 16, 64, seed=1),
        encoder_hidden_states=randn(1, 8, 64, seed=2),
        pooled_projections=randn(1, 32, seed=3),
        timestep=torch.tensor([0.5], dtype=torch.bfloat16),
        img_ids=_ids(16, 3, image=True),
        txt_ids=torch.zeros(8, 3),
        guidance=torch.tensor([3.5], dtype=torch.bfloat16),
        return_dict=False,
    ),
)

FLUX2_KLEIN = Case(
    "flux2_klein.Flux2Transformer2DModel",
    "vllm_omni.diffusion.models.flux2_klein.flux2_klein_transformer",
    dict(
        patch_size=1,
        in_channels=128,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=128,
        num_attention_heads=4,
        joint_attention_dim=64,
        timestep_guidance_channels=256,
        axes_dims_rope=(32, 32, 32, 32),
        guidance_embeds=False,
    ),
    lambda: dict(
        hidden_states=randn(1, 16, 128, seed=1),
        encoder_hidden_states=randn(1, 8, 64, seed=2),
        timestep=torch.tensor([0.5], dtype=torch.bfloat16),
        img_ids=_ids(16, 4, image=True),
        txt_ids=_ids(8, 4, image=False),
        return_dict=False,
    ),
)

FLUX2 = Case(
    "flux2.Flux2Transformer2DModel",
    "vllm_omni.diffusion.models.flux2.flux2_transformer",
    dict(FLUX2_KLEIN.config, guidance_embeds=True),
    lambda: dict(FLUX2_KLEIN.inputs(), guidance=torch.tensor([4.0], dtype=torch.bfloat16)),
)

Z_IMAGE = Case(
    "z_image.ZImageTransformer2DModel",
    "vllm_omni.diffusion.models.z_image.z_image_transformer",
    dict(
        in_channels=16,
        dim=768,  # FFN hidden int(dim / 3 * 8) = 2048 (dim 512 would give an odd K of 1365)
        n_layers=1,
        n_refiner_layers=1,
        n_heads=6,
        n_kv_heads=6,
        cap_feat_dim=64,
        axes_dims=[32, 48, 48],
        axes_lens=[64, 64, 64],
    ),
    lambda: dict(
        x=[randn(16, 1, 8, 8, seed=1)],
        t=torch.tensor([0.5], dtype=torch.bfloat16),
        cap_feats=[randn(8, 64, seed=2)],
    ),
    output=lambda out: out[0][0],
)


HUNYUAN_VIDEO_15 = Case(
    "hunyuan_video.HunyuanVideo15Transformer3DModel",
    "vllm_omni.diffusion.models.hunyuan_video.hunyuan_video_15_transformer",
    dict(
        in_channels=65,
        out_channels=32,
        num_attention_heads=4,
        attention_head_dim=128,
        num_layers=1,
        num_refiner_layers=1,
        text_embed_dim=64,
        text_embed_2_dim=32,
        image_embed_dim=64,
        rope_axes_dim=(16, 56, 56),
        task_type="t2v",
    ),
    lambda: dict(
        hidden_states=randn(1, 65, 2, 4, 4, seed=1),
        timestep=torch.tensor([500.0], dtype=torch.bfloat16),
        encoder_hidden_states=randn(1, 8, 64, seed=2),
        encoder_attention_mask=torch.ones(1, 8, dtype=torch.long),
        encoder_hidden_states_2=randn(1, 4, 32, seed=3),
        encoder_attention_mask_2=torch.ones(1, 4, dtype=torch.long),
        image_embeds=randn(1, 4, 64, seed=4),
        image_embeds_mask=torch.ones(1, 4, dtype=torch.long),
        return_dict=False,
    ),
)


LTX2 = Case(
    "ltx2.LTX2VideoTransformer3DModel",
    "vllm_omni.diffusion.models.ltx2.ltx2_transformer",
    dict(
        in_channels=128,
        out_channels=128,
        num_attention_heads=4,
        attention_head_dim=128,
        cross_attention_dim=512,
        audio_in_channels=128,
        audio_out_channels=128,
        audio_num_attention_heads=4,
        audio_attention_head_dim=64,
        audio_cross_attention_dim=256,
        num_layers=1,
        caption_channels=64,
    ),
    lambda: dict(
        hidden_states=randn(1, 16, 128, seed=1),
        audio_hidden_states=randn(1, 8, 128, seed=2),
        encoder_hidden_states=randn(1, 8, 64, seed=3),
        audio_encoder_hidden_states=randn(1, 8, 64, seed=4),
        timestep=torch.tensor([0.5], dtype=torch.bfloat16),
        num_frames=1,
        height=4,
        width=4,
        audio_num_frames=8,
        return_dict=False,
    ),
)


ERNIE_IMAGE = Case(
    "ernie_image.ErnieImageTransformer2DModel",
    "vllm_omni.diffusion.models.ernie_image.ernie_image_transformer",
    dict(
        patch_size=1,
        in_channels=128,
        num_layers=2,
        num_attention_heads=4,
        ffn_hidden_size=1024,
        hidden_size=512,
        text_in_dim=64,
        rope_axes_dim=(32, 48, 48),
    ),
    lambda: dict(
        hidden_states=randn(1, 128, 4, 4, seed=1),
        timestep=torch.tensor([500.0], dtype=torch.bfloat16),
        text_bth=randn(1, 8, 64, seed=2),
        text_lens=torch.tensor([8]),
        return_dict=False,
    ),
)

HELIOS = Case(
    "helios.HeliosTransformer3DModel",
    "vllm_omni.diffusion.models.helios.helios_transformer",
    dict(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=64,
        freq_dim=32,
        ffn_dim=1024,
        num_layers=2,
        rope_dim=(44, 42, 42),
    ),
    lambda: dict(
        hidden_states=randn(1, 16, 3, 8, 8, seed=1),
        timestep=torch.tensor([500]),
        encoder_hidden_states=randn(1, 16, 64, seed=2),
        return_dict=False,
    ),
)


FLUX_KONTEXT = Case(
    "flux.FluxKontextTransformer2DModel",
    "vllm_omni.diffusion.models.flux.flux_transformer",
    FLUX.config,
    FLUX.inputs,
)

# Ming's two transformers subclass Z-Image's without changing its constructor or Linears.
MING_FLASH_OMNI = Case(
    "ming_flash_omni.MingZImageTransformer2DModel",
    "vllm_omni.diffusion.models.ming_flash_omni.ming_zimage_transformer",
    Z_IMAGE.config,
    Z_IMAGE.inputs,
    Z_IMAGE.output,
)

MING_IMAGE = Case(
    "ming_image.MingImageTransformer2DModel",
    "vllm_omni.diffusion.models.ming_image.transformer",
    Z_IMAGE.config,
    Z_IMAGE.inputs,
    Z_IMAGE.output,
)

WAN_VACE = Case(
    "wan2_2.WanVACETransformer3DModel",
    "vllm_omni.diffusion.models.wan2_2.wan2_2_vace_transformer",
    dict(WAN.config, vace_layers=[0], vace_in_channels=16),
    lambda: dict(WAN.inputs(), vace_context=randn(1, 16, 3, 8, 8, seed=3)),
)

KREA2 = Case(
    "krea2.Krea2Transformer2DModel",
    "vllm_omni.diffusion.models.krea2.krea2_transformer",
    dict(
        in_channels=64,
        num_layers=2,
        attention_head_dim=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=1024,
        timestep_embed_dim=256,
        text_hidden_dim=256,
        num_text_layers=2,
        text_num_attention_heads=4,
        text_num_key_value_heads=4,
        text_intermediate_size=512,
        num_layerwise_text_blocks=1,
        num_refiner_text_blocks=1,
        axes_dims_rope=(32, 48, 48),
    ),
    lambda: dict(
        hidden_states=randn(1, 16, 64, seed=1),
        encoder_hidden_states=randn(1, 8, 2, 256, seed=2),  # (batch, text tokens, tapped layers, dim)
        timestep=torch.tensor([0.5], dtype=torch.bfloat16),
        position_ids=torch.cat([torch.zeros(8, 3), _ids(16, 3, image=True)]),
    ),
    output=lambda out: out,
)


def _omnigen2_inputs() -> dict:
    from vllm_omni.diffusion.models.omnigen2.omnigen2_transformer import OmniGen2RotaryPosEmbed

    return dict(
        hidden_states=randn(1, 16, 8, 8, seed=1),
        timestep=torch.tensor([0.5], dtype=torch.bfloat16),
        text_hidden_states=randn(1, 8, 64, seed=2),
        # as the pipeline computes them from the transformer's config
        freqs_cis=OmniGen2RotaryPosEmbed.get_freqs_cis((16, 24, 24), (64, 64, 64), theta=10000),
        text_attention_mask=torch.ones(1, 8, dtype=torch.bool),
        return_dict=False,
    )


OMNIGEN2 = Case(
    "omnigen2.OmniGen2Transformer2DModel",
    "vllm_omni.diffusion.models.omnigen2.omnigen2_transformer",
    dict(
        patch_size=2,
        in_channels=16,
        hidden_size=256,
        num_layers=2,
        num_refiner_layers=1,
        num_attention_heads=4,
        num_kv_heads=2,
        multiple_of=256,
        axes_dim_rope=(16, 24, 24),
        axes_lens=(64, 64, 64),
        text_feat_dim=64,
    ),
    _omnigen2_inputs,
)


def _boogu_inputs() -> dict:
    from vllm_omni.diffusion.models.boogu_image.boogu_image_transformer import (
        BooguImageDoubleStreamRotaryPosEmbed,
    )

    return dict(
        hidden_states=randn(1, 16, 8, 8, seed=1),
        timestep=torch.tensor([0.5], dtype=torch.bfloat16),
        instruction_hidden_states=randn(1, 8, 64, seed=2),
        freqs_real=BooguImageDoubleStreamRotaryPosEmbed.get_freqs_real(
            (16, 24, 24), (64, 64, 64), theta=10000
        ),
        instruction_attention_mask=torch.ones(1, 8, dtype=torch.bool),
    )


BOOGU_IMAGE = Case(
    "boogu_image.BooguImageTransformer2DModel",
    "vllm_omni.diffusion.models.boogu_image.boogu_image_transformer",
    dict(
        patch_size=2,
        in_channels=16,
        hidden_size=256,
        num_layers=2,
        num_double_stream_layers=1,
        num_refiner_layers=1,
        num_attention_heads=4,
        num_kv_heads=2,
        multiple_of=256,
        axes_dim_rope=(16, 24, 24),
        axes_lens=(64, 64, 64),
        instruction_feature_configs={
            "instruction_feat_dim": 64,
            "reduce_type": "mean",
            "num_instruction_feature_layers": 1,
        },
    ),
    _boogu_inputs,
    output=lambda out: out if isinstance(out, torch.Tensor) else out[0],
    config_in_od_config_only=True,
)

GLM_IMAGE = Case(
    "glm_image.GlmImageTransformer2DModel",
    "vllm_omni.diffusion.models.glm_image.glm_image_transformer",
    dict(
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_attention_heads=4,
        attention_head_dim=128,
        time_embed_dim=64,
        condition_dim=32,
        prior_vq_quantizer_codebook_size=64,
        text_embed_dim=64,
        num_layers=2,
    ),
    lambda: dict(
        hidden_states=randn(1, 16, 8, 8, seed=1),
        encoder_hidden_states=randn(1, 8, 64, seed=2),
        prior_token_id=torch.arange(16).reshape(1, 16) % 64,
        prior_token_drop=torch.zeros(1, 16, dtype=torch.bool),
        timestep=torch.tensor([500]),
        target_size=torch.tensor([[64.0, 64.0]]),
        crop_coords=torch.tensor([[0.0, 0.0]]),
        return_dict=False,
    ),
    config_in_od_config_only=True,
)


def _lingbot_world_inputs() -> dict:
    """One DMD probe step of the first causal block, as ``LingBotDMDBlockRunner.probe_step`` calls the
    transformer: a cache from ``allocate_lingbot_cache`` with the geometry ``allocate_cache`` gives this
    config (18-frame window x 4 x 4 post-patch tokens, 4 heads of 128), the folded camera grid, a fresh
    camera-modulation cache, the cache not committed."""
    from vllm_omni.diffusion.models.lingbot_world.transformer import (
        CameraModulationCache,
        allocate_lingbot_cache,
    )

    cache = allocate_lingbot_cache(
        batch_size=1,
        num_layers=2,
        max_tokens=18 * 4 * 4,
        num_local_heads=4,
        head_dim=128,
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
    )
    return dict(
        hidden_states=randn(1, 16, 3, 8, 8, seed=1),  # num_frames_per_block (3) latent frames
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=randn(1, 16, 32, seed=2),
        camera_hidden_states=randn(1, 6 * 8 * 8, 3, 8, 8, seed=3),
        cache=cache,
        start_frame=0,
        update_cache=False,
        camera_modulation_cache=CameraModulationCache(),
    )


LINGBOT_WORLD = Case(
    "lingbot_world.CausalLingBotWorldTransformer3DModel",
    "vllm_omni.diffusion.models.lingbot_world.transformer",
    dict(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=1024,
        num_layers=2,
        rope_max_seq_len=64,
    ),
    _lingbot_world_inputs,
    output=lambda out: out,
)


def _minimax_h3_inputs() -> dict:
    """One text-to-video-and-audio step, packed as the pipeline packs it: ``minimax_h3_packed_sequence``
    (8 text rows, one 4 x 4 latent frame, 4 audio steps, padded to 64 rows) and the step's keyword
    arguments from ``MiniMaxH3DenoiseBranch.forward_kwargs`` (rows of 96 video / 32 audio values)."""
    from vllm_omni.diffusion.models.minimax_h3.denoise_loop import MiniMaxH3DenoiseBranch
    from vllm_omni.diffusion.models.minimax_h3.packed_sequence import minimax_h3_packed_sequence

    packed = minimax_h3_packed_sequence(
        text_len=8, latent_t=1, latent_h=4, latent_w=4, audio_t=4, include_keyframe_cond=False
    )
    branch = MiniMaxH3DenoiseBranch(
        packed=packed,
        text_embeddings=randn(8, 64, seed=2),
        token_tags=packed["token_tags"].clone(),
        device=torch.device("cpu"),
    )
    return branch.forward_kwargs(
        video_rows=randn(len(branch.img_pos), 96, seed=1).float(),
        audio_rows=randn(len(branch.audio_pos), 32, seed=3).float(),
        t_video=0.5,
        t_audio=0.5,
        imgvid_cond_timestep=0.999,  # MINIMAX_H3_IMGVID_COND_TIMESTEP
        audio_ref_cond_timestep=1.0,  # MINIMAX_H3_AUDIO_REF_COND_TIMESTEP
    )


def _minimax_h3_rope(model) -> None:
    """``rope.inv_freq``, built empty: its ``load_weights`` computes it from ``rope_theta`` (default
    10000) for a Diffusers checkpoint, ``theta ** -(arange(0, 2n, 2) / 2n)`` for n = rope_inv_freq_len."""
    n = model.rope.inv_freq.numel()
    model.rope.inv_freq.copy_(1.0 / 10000.0 ** (torch.arange(0, 2 * n, 2, dtype=torch.float32) / (2 * n)))


MINIMAX_H3 = Case(
    "minimax_h3.MiniMaxH3DiTModel",
    "vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer",
    dict(
        num_layers=2,
        token_refiner_num_layers=1,
        hidden_size=512,
        num_attention_heads=4,
        attention_head_dim=128,
        ffn_hidden_size=1024,
        # the released widths: the denoise loop packs rows of 24 x (1 x 2 x 2) video and 32 audio values
        latents_dim=24,
        audio_latents_dim=32,
        text_dim=64,
        timestep_input_dim=64,
        time_embed_hidden_size=512,
        time_embed_dim=256,
        adaln_out_features=18 * 512,
        final_adaln_out_features=2 * 512,
    ),
    _minimax_h3_inputs,
    output=lambda out: torch.cat([out[0].flatten(), out[1].flatten()]),  # (video rows, audio rows)
    config_in_od_config_only=True,
    computed_buffers=_minimax_h3_rope,
)


def _hidream_image_inputs() -> dict:
    """As the pipeline calls it: latents (B, C, H, W), one timestep per sample, T5 embeddings, the Llama
    hidden states stacked per layer (layers, B, tokens, dim; ``llama_layers`` picks from them) and the
    pooled CLIP embeddings."""
    return dict(
        hidden_states=randn(1, 16, 8, 8, seed=1),
        timesteps=torch.tensor([500.0]),
        encoder_hidden_states_t5=randn(1, 8, 64, seed=2),
        encoder_hidden_states_llama3=randn(1, 1, 8, 64, seed=3),
        pooled_embeds=randn(1, 64, seed=4),
        return_dict=False,
    )


HIDREAM_IMAGE = Case(
    "hidream_image.HiDreamImageTransformer2DModel",
    "vllm_omni.diffusion.models.hidream_image.hidream_image_transformer",
    dict(
        patch_size=2,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=64,
        num_attention_heads=4,
        caption_channels=[64, 64],
        text_emb_dim=64,
        num_routed_experts=2,
        num_activated_experts=1,
        axes_dims_rope=(
            32,
            16,
            16,
        ),  # one per position axis (3), summing to the head dim (released: 64, 32, 32)
        llama_layers=[0],
    ),
    _hidream_image_inputs,
)


def _sana_wm_config() -> dict:
    from vllm_omni.diffusion.models.sana_wm.config import SanaWmConfig

    config = SanaWmConfig(
        num_blocks=2, hidden_size=256, linear_head_dim=64, softmax_every_n=2, chunk_plucker_post_attn_blocks=2
    )
    return dict(config=config)


def sana_wm_inputs() -> dict:
    """One denoise step of Sana-WM's pipeline (``SanaWmPipeline`` sampling loop): 9 frames at 128 x 128
    (2 latent frames of 4 x 4), the per-frame fp32 timestep (1, 1, F) with the conditioning frame 0 at
    0, an all-ones prompt mask passed as None, and the camera tensors of ``build_plucker_condition``
    for a walk-forward action, in bf16."""
    from vllm_omni.diffusion.models.sana_wm.camera_control import (
        SanaWmCameraCondition,
        build_plucker_condition,
    )

    camera = build_plucker_condition(SanaWmCameraCondition(action="w-9", num_frames=9, height=128, width=128))
    timestep = torch.full((1, 1, 2), 500.0)
    timestep[:, :, 0] = 0.0
    return dict(
        hidden_states=randn(1, 16, 2, 4, 4, seed=1),
        timestep=timestep,
        encoder_hidden_states=randn(1, 8, 64, seed=2),
        encoder_attention_mask=None,
        plucker=camera["chunk_plucker"].to(torch.bfloat16),
        raymap=camera["raymap"].to(torch.bfloat16),
        spatial_raymap=camera["spatial_raymap"].to(torch.bfloat16),
    )


# its two Linears whose input the model casts to their weight dtype stay BF16 (the required family
# default, vllm_omni_mxfp4/config/defaults.py; tests/models/test_upstream_forward_gaps.py)
SANA_WM = Case(
    "sana_wm.SanaWmTransformer3DModel",
    "vllm_omni.diffusion.models.sana_wm.sana_wm_transformer",
    dict(latent_channels=16, prompt_channels=64, dtype=torch.bfloat16),
    sana_wm_inputs,
    extra=_sana_wm_config,
    output=lambda out: out,
)


def _ids(n: int, axes: int, *, image: bool) -> torch.Tensor:
    """Position ids (n, axes): a 4 x (n/4) grid on the last two axes for image tokens, text
    positions on the last axis otherwise."""
    ids = torch.zeros(n, axes)
    if image:
        ids[:, -2] = torch.arange(n) // 4
        ids[:, -1] = torch.arange(n) % 4
    else:
        ids[:, -1] = torch.arange(n)
    return ids


CASES = {
    case.key: case
    for case in (
        WAN,
        QWEN_IMAGE,
        FLUX,
        FLUX2,
        FLUX2_KLEIN,
        Z_IMAGE,
        HUNYUAN_VIDEO_15,
        LTX2,
        ERNIE_IMAGE,
        HELIOS,
        FLUX_KONTEXT,
        MING_FLASH_OMNI,
        MING_IMAGE,
        WAN_VACE,
        KREA2,
        OMNIGEN2,
        BOOGU_IMAGE,
        GLM_IMAGE,
        HIDREAM_IMAGE,
        LINGBOT_WORLD,
        MINIMAX_H3,
        SANA_WM,
    )
}
