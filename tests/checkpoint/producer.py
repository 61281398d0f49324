"""Real msModelSlim exports of a tiny two-expert Wan2.2 model, built on CPU in seconds.

The BF16 original is a diffusers pipeline directory (``WanTransformer3DModel`` per expert plus small
stand-in components). The same weights are loaded into a module tree with the ORIGINAL Wan names
(``blocks.N.self_attn.q``, ``ffn.0``, ``norm3``, ``modulation``, ``head.head``, ...), which is what
msModelSlim quantizes. Quantization uses msModelSlim's own pieces, the lowest-level ones that need no
NPU and no model adapter:

- Smooth: ``iter_smooth_impl_non_fusion_linear`` (the iter_smooth API for a NonFusionSubgraph) on
  synthetic activation statistics, then ``NonFusionSmoothQuantHookIR`` on each Linear, exactly as
  ``IterSmoothProcessor.apply_smooth_algorithm`` does;
- ``LinearQuantProcessor`` with its pydantic config (W4A4_MXFP4 per-block minmax or
  W4A4_MXFP4_DUALSCALE ``dualscale``), driven with ``BatchProcessRequest`` per top-level module;
- the ``mindie_format_saver`` or ``ascendv1_saver`` processors, optionally sharded with msModelSlim's
  ``BufferedSafetensorsWriter``.

The diffusers -> original renames here are written independently of
``vllm_omni_mxfp4.checkpoint.names`` (regular expressions, not tables), so a wrong table there cannot
be mirrored here.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=64,
    freq_dim=256,
    ffn_dim=1024,
    num_layers=3,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)
DIM = TINY["num_attention_heads"] * TINY["attention_head_dim"]

_RENAMES = [
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^proj_out\.", "head.head."),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^(blocks\.\d+)\.scale_shift_table$", r"\1.modulation"),
    (r"\.attn1\.to_out\.0\.", ".self_attn.o."),
    (r"\.attn2\.to_out\.0\.", ".cross_attn.o."),
    (r"\.attn1\.to_([qkv])\.", r".self_attn.\1."),
    (r"\.attn2\.to_([qkv])\.", r".cross_attn.\1."),
    (r"\.attn1\.norm_([qk])\.", r".self_attn.norm_\1."),
    (r"\.attn2\.norm_([qk])\.", r".cross_attn.norm_\1."),
    (r"^(blocks\.\d+)\.norm2\.", r"\1.norm3."),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."),
    (r"\.ffn\.net\.2\.", ".ffn.2."),
]


def original_name(diffusers_name: str) -> str:
    """The original Wan name of a diffusers tensor name of the tiny model (fixture-side mapping)."""
    name = diffusers_name
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


class _RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class _Attention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = _RMSNorm(dim), _RMSNorm(dim)


class _Block(nn.Module):
    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.self_attn = _Attention(dim)
        self.norm3 = nn.LayerNorm(dim, elementwise_affine=True)
        self.cross_attn = _Attention(dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.ffn = nn.Sequential(
            nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim)
        )
        self.modulation = nn.Parameter(torch.zeros(1, 6, dim))


class _Head(nn.Module):
    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.head = nn.Linear(dim, out_dim)
        self.modulation = nn.Parameter(torch.zeros(1, 2, dim))


class OriginalWan(nn.Module):
    """The parameter tree of the original Wan repo's ``WanModel`` (no forward needed)."""

    def __init__(self, cfg: dict = TINY):
        super().__init__()
        dim, patch = DIM, cfg["patch_size"]
        self.patch_embedding = nn.Conv3d(cfg["in_channels"], dim, kernel_size=patch, stride=patch)
        self.text_embedding = nn.Sequential(
            nn.Linear(cfg["text_dim"], dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim)
        )
        self.time_embedding = nn.Sequential(nn.Linear(cfg["freq_dim"], dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
        self.blocks = nn.ModuleList(_Block(dim, cfg["ffn_dim"]) for _ in range(cfg["num_layers"]))
        self.head = _Head(dim, cfg["out_channels"] * math.prod(patch))


def original_model(diffusers_state: dict[str, torch.Tensor]) -> OriginalWan:
    """An :class:`OriginalWan` holding exactly the diffusers weights (strict in both directions)."""
    model = OriginalWan().to(torch.bfloat16)
    state = {original_name(k): v for k, v in diffusers_state.items()}
    model.load_state_dict(state, strict=True)
    return model


def build_pipeline(
    root: Path, *, transformers=("transformer", "transformer_2"), pipeline="WanPipeline", seed: int = 0
) -> dict[str, dict[str, torch.Tensor]]:
    """A diffusers pipeline dir with random BF16 tiny transformers and stand-in components."""
    from diffusers import WanTransformer3DModel

    root.mkdir(parents=True)
    states = {}
    index: dict[str, object] = {
        "_class_name": pipeline,
        "_diffusers_version": "0.40.0",
        "boundary_ratio": 0.875,
    }
    for i, folder in enumerate(transformers):
        torch.manual_seed(seed + i)
        model = WanTransformer3DModel(**TINY)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.05)
        model = model.to(torch.bfloat16)
        model.save_pretrained(root / folder)
        states[folder] = {k: v.clone() for k, v in model.state_dict().items()}
        index[folder] = ["diffusers", "WanTransformer3DModel"]
    if "transformer_2" not in transformers:
        index["transformer_2"] = [None, None]
    index.update(
        vae=["diffusers", "AutoencoderKLWan"],
        text_encoder=["transformers", "UMT5EncoderModel"],
        tokenizer=["transformers", "T5TokenizerFast"],
        scheduler=["diffusers", "UniPCMultistepScheduler"],
    )
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    gen = torch.Generator().manual_seed(seed + 100)
    from safetensors.torch import save_file

    for folder, config_name, weights in (
        ("vae", "config.json", "diffusion_pytorch_model.safetensors"),
        ("text_encoder", "config.json", "model.safetensors"),
    ):
        (root / folder).mkdir()
        (root / folder / config_name).write_text(json.dumps({"_class_name": folder, "seed": seed}))
        save_file({"w": torch.randn(64, 32, generator=gen)}, str(root / folder / weights))
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer.json").write_text(json.dumps({"vocab": {"a": 0, "cat": 1}}))
    (root / "tokenizer" / "spiece.model").write_bytes(bytes(range(256)) * 3)
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": "UniPCMultistepScheduler"})
    )
    (root / "README.md").write_text("tiny Wan2.2 test pipeline\n")
    return states


@dataclass
class ExpertSpec:
    """How msModelSlim quantizes one expert."""

    fmt: str  # "dual" (W4A4_MXFP4_DUALSCALE) or "single" (W4A4_MXFP4)
    saver: str  # "mindie" or "ascendv1"
    exclude: list[str]  # msModelSlim linear_quant exclude patterns (original names)
    smooth: list[list[str]] = field(default_factory=list)  # Linear groups sharing one Smooth subgraph
    shard_bytes: int | None = None


@dataclass
class LayerReference:
    """What msModelSlim quantized for one Linear: dequantized values (float64) and its Smooth scale."""

    values: torch.Tensor
    mul_scale: torch.Tensor | None


NON_BLOCK_EXCLUDES = ["head.*", "text_embedding.*", "time_embedding.*", "time_projection.*"]


def _qconfig(fmt: str):
    from msmodelslim.core.quantizer.base import QConfig
    from msmodelslim.core.quantizer.linear import LinearQConfig

    if fmt == "dual":
        q = QConfig(
            dtype="mxfp4",
            scope="dual_scale",
            symmetric=True,
            method="dualscale",
            ext={"dual_block_size": 512},
        )
    else:
        q = QConfig(dtype="mxfp4", scope="per_block", symmetric=True, method="minmax")
    return LinearQConfig(act=q, weight=q)


def _smooth(model: nn.Module, groups: list[list[str]], seed: int) -> None:
    from msmodelslim.ir.non_fusion_smooth_quant_ir import NonFusionSmoothQuantHookIR
    from msmodelslim.processor.anti_outlier.common.smooth_types import IterSmoothConfig, IterSmoothContext
    from msmodelslim.processor.anti_outlier.common.subgraph_type import NonFusionSubgraph
    from msmodelslim.processor.anti_outlier.iter_smooth.api import iter_smooth_impl_non_fusion_linear

    gen = torch.Generator().manual_seed(seed)
    for group in groups:
        linears = [model.get_submodule(name) for name in group]
        k = linears[0].in_features
        act_amax = (torch.rand(k, generator=gen) * 8 + 0.05).to(torch.bfloat16)
        context = IterSmoothContext(version=1, a_smooth_scale=act_amax, shift=None)
        scales = iter_smooth_impl_non_fusion_linear(
            NonFusionSubgraph(linears=linears, linear_names=group), IterSmoothConfig(), context
        )
        for linear in linears:
            hook = NonFusionSmoothQuantHookIR(scales)
            hook.set_hook_handle(linear.register_forward_pre_hook(hook))


def _reference(module: nn.Module) -> LayerReference | None:
    import msmodelslim.ir as qir

    mul_scale = None
    if isinstance(module, qir.NonFusionSmoothQuantWrapper):
        mul_scale = module.scales.detach().double().clone()
        module = module.wrapped_module
    if isinstance(module, qir.W4A4MXDynamicDualScaleFakeQuantLinear):
        dual = module.weight_dual_scale.detach().double().squeeze(-1).repeat_interleave(512, dim=1)
    elif isinstance(module, qir.W4A4MXDynamicPerBlockFakeQuantLinear):
        dual = None
    else:
        return None
    k = module.weight.shape[1]
    exponent = module.weight_scale.detach().double().squeeze(-1).repeat_interleave(32, dim=1)[:, :k]
    values = module.weight.detach().double() * torch.exp2(exponent)
    if dual is not None:
        values = values * dual[:, :k]
    return LayerReference(values, mul_scale)


def _adapter(model_path: Path):
    """A minimal msModelSlim model adapter: the savers read ``model_path`` (and AscendV1 checks IModel)."""
    from msmodelslim.model import IModel

    class Adapter(IModel):
        model_type = property(lambda self: "Wan2_2")
        model_path = property(lambda self: model_path)
        trust_remote_code = property(lambda self: False)

    return Adapter()


def quantize_expert(
    diffusers_state: dict[str, torch.Tensor], save_dir: Path, spec: ExpertSpec, seed: int = 0
) -> dict[str, LayerReference]:
    """Run msModelSlim on one expert; returns references by ORIGINAL layer name."""
    from msmodelslim.core.base.protocol import BatchProcessRequest
    from msmodelslim.core.quant_service.modelslim_v1.save.ascendv1 import AscendV1Config, AscendV1Saver
    from msmodelslim.core.quant_service.modelslim_v1.save.mindie_format import (
        MindIEFormatConfig,
        MindIEFormatSaver,
    )
    from msmodelslim.core.quant_service.modelslim_v1.save.utils.safetensors import (
        ONE_GB_FILE_BYTES,
        BufferedSafetensorsWriter,
    )
    from msmodelslim.processor.quant.linear import LinearProcessorConfig, LinearQuantProcessor
    from msmodelslim.utils.logging import logger

    model = original_model(diffusers_state)
    _smooth(model, spec.smooth, seed)
    quant = LinearQuantProcessor(
        model, LinearProcessorConfig(qconfig=_qconfig(spec.fmt), include=["*"], exclude=spec.exclude)
    )
    requests = [BatchProcessRequest(name=name, module=module) for name, module in model.named_children()]
    requests = [r for r in requests if r.name != "blocks"]
    requests += [BatchProcessRequest(name=f"blocks.{i}", module=b) for i, b in enumerate(model.blocks)]
    for request in requests:
        quant.preprocess(request)
        quant.postprocess(request)
    quant.post_run()
    references = {}
    for name, module in model.named_modules():
        ref = _reference(module)
        if ref is not None:
            references[name] = ref

    save_dir.mkdir(parents=True)
    source = save_dir.parent / f".{save_dir.name}-model-path"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "t2v", "dim": DIM}))
    if spec.saver == "mindie":
        saver = MindIEFormatSaver(
            model, MindIEFormatConfig(save_directory=str(save_dir), part_file_size=0), _adapter(source)
        )
        prefix = "quant_model_weight"
    else:
        saver = AscendV1Saver(
            model, AscendV1Config(save_directory=str(save_dir), part_file_size=0), _adapter(source)
        )
        prefix = "quant_model_weights"
    if spec.shard_bytes:
        saver.safetensors_writer = BufferedSafetensorsWriter(
            logger=logger,
            max_gb_size=spec.shard_bytes / ONE_GB_FILE_BYTES,
            save_directory=str(save_dir),
            save_prefix=prefix,
        )
    for request in requests:
        saver.preprocess(request)
        saver.postprocess(request)
    saver.post_run()
    return references


def all_linears(block: int, *, cross_kv_together: bool = True) -> list[list[str]]:
    """Smooth groups covering every Linear of a block (Linears that share an input share a group)."""
    p = f"blocks.{block}"
    groups = [[f"{p}.self_attn.q", f"{p}.self_attn.k", f"{p}.self_attn.v"], [f"{p}.self_attn.o"]]
    groups += [[f"{p}.cross_attn.q"]]
    groups += (
        [[f"{p}.cross_attn.k", f"{p}.cross_attn.v"]]
        if cross_kv_together
        else [
            [f"{p}.cross_attn.k"],
            [f"{p}.cross_attn.v"],
        ]
    )
    groups += [[f"{p}.cross_attn.o"], [f"{p}.ffn.0"], [f"{p}.ffn.2"]]
    return groups
