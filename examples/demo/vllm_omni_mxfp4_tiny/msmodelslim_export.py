"""Real msModelSlim exports of a diffusers Wan2.2 pipeline, made on CPU (offline quantization step).

msModelSlim quantizes the ORIGINAL Wan module tree (``blocks.N.self_attn.q``, ``ffn.0``, ``norm3``,
``modulation``, ``head.head``, ...), not the diffusers one. :func:`export_pipeline` loads each
transformer of a diffusers pipeline directory into that tree and quantizes it with msModelSlim's own
pieces — the lowest-level ones, which need no NPU and no model adapter:

- optionally ``svd_res`` (``SVDResidualProcessor``, data-free) on the Linears ``ExpertSpec.svd``
  matches, before Smooth: each keeps a low-rank pair and its residual is quantized;
- Smooth: ``iter_smooth_impl_non_fusion_linear`` (the iter_smooth API for a NonFusionSubgraph), then
  ``NonFusionSmoothQuantHookIR`` on each Linear, as ``IterSmoothProcessor.apply_smooth_algorithm``
  does. The per-channel activation maxima come from a calibration run of the pipeline
  (:mod:`vllm_omni_mxfp4_tiny.calibration`, what ``msmodelslim quant`` does with its calibration
  prompts) or, for a model whose outputs mean nothing (random weights), are synthetic (seeded), so
  that the Smooth factors exercise the format;
- ``LinearQuantProcessor`` with its pydantic config (W4A4_MXFP4 per-block minmax, or
  W4A4_MXFP4_DUALSCALE ``dualscale``), one ``BatchProcessRequest`` per top-level module;
- the ``mindie_format_saver`` or ``ascendv1_saver`` processor, optionally sharded with msModelSlim's
  ``BufferedSafetensorsWriter``.

The result is what ``msmodelslim quant --model_type Wan2_2`` writes: ``high_noise_model/`` and
``low_noise_model/`` for a two-expert pipeline (the export root for one expert), each with
``quant_model_weight*.safetensors`` and ``quant_model_description*.json``; feed it to
``vllm-omni-mxfp4 merge``. The diffusers -> original renames and the expert folders are written
independently of :mod:`vllm_omni_mxfp4.checkpoint` (``names``, ``merger.MODEL_TYPES``), so the
merge's tables are checked against a second implementation: keep them apart.

msModelSlim is a dependency of the demo distribution (``vllm-omni-mxfp4-demo``), imported only when a
quantization runs.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import logging
import math
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: diffusers transformer folder -> msModelSlim expert folder of a two-expert (A14B) export; an
#: independent copy of what the merge expects (this module is the merge's test oracle).
EXPERT_FOLDERS = {"transformer": "high_noise_model", "transformer_2": "low_noise_model"}

#: msModelSlim ``exclude`` patterns that keep every Linear outside the blocks in FLOAT.
NON_BLOCK_EXCLUDES = ["head.*", "text_embedding.*", "time_embedding.*", "time_projection.*"]

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

_UNSUPPORTED_KEYS = ("image_dim", "added_kv_proj_dim")


def require_msmodelslim() -> None:
    """Raise ImportError with the install command when msModelSlim is not installed."""
    if importlib.util.find_spec("msmodelslim") is None:
        raise ImportError(
            "msModelSlim is not installed; the offline quantization step needs it: "
            "pip install 'msmodelslim>=26.1' (a dependency of vllm-omni-mxfp4-demo; runs on CPU)."
        )


@contextlib.contextmanager
def collections_skip_older_objects() -> Iterator[None]:
    """Within the block, garbage collections look only at objects created inside it.

    msModelSlim's ``LayerWiseRunner`` calls ``gc.collect()`` after every processor of every block (to
    free device memory on an NPU). A full collection walks every object the process tracks, and a
    process that has imported torch, transformers and diffusers (a test worker: vLLM too) tracks
    millions: about 0.3 s per call, 94 % of a tiny recipe run. ``gc.freeze()`` moves the objects that
    exist on entry to the permanent generation, which collections skip; ``gc.unfreeze()`` hands them
    back on exit. What the run computes is unchanged; only garbage from before the block that turns
    unreachable inside it waits until the next collection after the block. Not reentrant: the
    inner block's exit would unfreeze the outer one's objects.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def original_name(diffusers_name: str) -> str:
    """The original Wan name of a diffusers ``WanTransformer3DModel`` tensor name."""
    name = diffusers_name
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


class _RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class _Attention(nn.Module):
    def __init__(self, dim: int, qk_norm: bool):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        if qk_norm:
            self.norm_q, self.norm_k = _RMSNorm(dim), _RMSNorm(dim)


class _Block(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, qk_norm: bool, cross_attn_norm: bool):
        super().__init__()
        self.self_attn = _Attention(dim, qk_norm)
        if cross_attn_norm:
            self.norm3 = nn.LayerNorm(dim, elementwise_affine=True)
        self.cross_attn = _Attention(dim, qk_norm)
        self.ffn = nn.Sequential(
            nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim)
        )
        self.modulation = nn.Parameter(torch.zeros(1, 6, dim))


class _Head(nn.Module):
    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.head = nn.Linear(dim, out_dim)
        self.modulation = nn.Parameter(torch.zeros(1, 2, dim))


class OriginalWan(nn.Module):
    """The parameter tree of the original Wan repository's ``WanModel`` (no forward needed).

    Built from a diffusers ``WanTransformer3DModel`` config (``transformer/config.json``); the
    image-conditioned variants (``image_dim``, ``added_kv_proj_dim``) are not supported.
    """

    def __init__(self, config: Mapping[str, Any]):
        super().__init__()
        for key in _UNSUPPORTED_KEYS:
            if config.get(key) is not None:
                raise NotImplementedError(
                    f"transformer config key {key}={config[key]!r}: image-conditioned Wan models are not "
                    "supported by this exporter (text-to-video only)"
                )
        try:
            dim = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
            patch = tuple(config["patch_size"])
            in_channels, out_channels = int(config["in_channels"]), int(config["out_channels"])
            text_dim, freq_dim = int(config["text_dim"]), int(config["freq_dim"])
            ffn_dim, layers = int(config["ffn_dim"]), int(config["num_layers"])
        except KeyError as exc:
            raise ValueError(f"transformer config: missing key {exc.args[0]!r}") from None
        qk_norm = bool(config.get("qk_norm", "rms_norm_across_heads"))
        cross_attn_norm = bool(config.get("cross_attn_norm", True))
        self.dim = dim
        self.patch_embedding = nn.Conv3d(in_channels, dim, kernel_size=patch, stride=patch)
        self.text_embedding = nn.Sequential(
            nn.Linear(text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim)
        )
        self.time_embedding = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
        self.blocks = nn.ModuleList(_Block(dim, ffn_dim, qk_norm, cross_attn_norm) for _ in range(layers))
        self.head = _Head(dim, out_channels * math.prod(patch))


def original_model(diffusers_state: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> OriginalWan:
    """An :class:`OriginalWan` holding exactly the diffusers weights (strict in both directions)."""
    model = OriginalWan(config).to(torch.bfloat16)
    state = {original_name(k): v for k, v in diffusers_state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            "the diffusers transformer does not map onto the original Wan tree: "
            f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}"
        )
    return model


@dataclass
class ExpertSpec:
    """How msModelSlim quantizes one expert.

    ``fmt``: ``"dual"`` (W4A4_MXFP4_DUALSCALE) or ``"single"`` (W4A4_MXFP4); ``saver``: ``"mindie"``
    or ``"ascendv1"``; ``exclude``: msModelSlim ``exclude`` patterns (original names) that stay FLOAT;
    ``smooth``: groups of Linears (original names) sharing one Smooth subgraph; ``shard_bytes``:
    shard the safetensors output; ``svd``: msModelSlim ``include`` patterns of its ``svd_res``
    processor (run first, with ``svd_rank``), whose Linears get a low-rank pair and a quantized
    residual (only the ascendv1 saver writes the pair).
    """

    fmt: str
    saver: str
    exclude: list[str]
    smooth: list[list[str]] = field(default_factory=list)
    shard_bytes: int | None = None
    svd: list[str] = field(default_factory=list)
    svd_rank: int = 16

    def __post_init__(self) -> None:
        if self.fmt not in ("dual", "single"):
            raise ValueError(f"ExpertSpec.fmt must be 'dual' or 'single', got {self.fmt!r}")
        if self.saver not in ("mindie", "ascendv1"):
            raise ValueError(f"ExpertSpec.saver must be 'mindie' or 'ascendv1', got {self.saver!r}")
        if self.svd and self.saver != "ascendv1":
            raise ValueError(
                "ExpertSpec.svd needs saver 'ascendv1': msModelSlim's mindie_format saver drops the low-rank "
                "pair and keeps the residual's plain label, which no reader can tell from a whole weight"
            )


@dataclass
class LayerReference:
    """What msModelSlim quantized for one Linear: dequantized values (float64), its Smooth scale, its
    low-rank pair ``(l1, l2)`` where ``svd_res`` wrapped it, and msModelSlim's deployed module (the
    wrappers around its fake-quant Linear), which computes the layer as msModelSlim's model does."""

    values: torch.Tensor
    mul_scale: torch.Tensor | None
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None
    module: nn.Module | None = None


def all_linears(block: int, *, cross_kv_together: bool = True) -> list[list[str]]:
    """Smooth groups covering every Linear of a block (Linears that share an input share a group)."""
    p = f"blocks.{block}"
    groups = [[f"{p}.self_attn.q", f"{p}.self_attn.k", f"{p}.self_attn.v"], [f"{p}.self_attn.o"]]
    groups += [[f"{p}.cross_attn.q"]]
    if cross_kv_together:
        groups += [[f"{p}.cross_attn.k", f"{p}.cross_attn.v"]]
    else:
        groups += [[f"{p}.cross_attn.k"], [f"{p}.cross_attn.v"]]
    groups += [[f"{p}.cross_attn.o"], [f"{p}.ffn.0"], [f"{p}.ffn.2"]]
    return groups


def default_specs(num_layers: int, experts: tuple[str, ...]) -> dict[str, ExpertSpec]:
    """The demo's recipe: dual-scale in the blocks, some of them FLOAT, Smooth on every quantized Linear.

    ``transformer`` keeps ``blocks.0`` FLOAT (the sensitive first block, as in the user guide's
    example); ``transformer_2`` quantizes every block but keeps the last block's FFN down-projection
    (``ffn.2``) FLOAT, so its BF16 layer sits between quantized ones. Every quantized Linear gets a
    Smooth factor (msModelSlim's iter_smooth; Q/K/V and cross-attention K/V share theirs), since
    offline ``mxfp4_dualscale`` loads a ``mul_scale`` for each quantized layer. Linears outside the
    blocks stay FLOAT: vLLM-Omni runs them in BF16.
    """
    if num_layers < 2:
        raise ValueError(f"default_specs needs at least 2 transformer blocks, got {num_layers}")
    last = num_layers - 1
    float_ffn = f"blocks.{last}.ffn.2"
    specs = {
        "transformer": ExpertSpec(
            "dual",
            "mindie",
            exclude=["*blocks.0.*", *NON_BLOCK_EXCLUDES],
            smooth=[group for block in range(1, num_layers) for group in all_linears(block)],
        ),
        "transformer_2": ExpertSpec(
            "dual",
            "mindie",
            exclude=[float_ffn, *NON_BLOCK_EXCLUDES],
            smooth=[
                group for block in range(num_layers) for group in all_linears(block) if group != [float_ffn]
            ],
        ),
    }
    return {name: specs[name] for name in experts}


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


def _smooth(
    model: nn.Module,
    groups: list[list[str]],
    seed: int,
    maxima: Mapping[str, torch.Tensor] | None = None,
) -> None:
    from msmodelslim.ir.non_fusion_smooth_quant_ir import NonFusionSmoothQuantHookIR
    from msmodelslim.processor.anti_outlier.common.smooth_types import IterSmoothConfig, IterSmoothContext
    from msmodelslim.processor.anti_outlier.common.subgraph_type import NonFusionSubgraph
    from msmodelslim.processor.anti_outlier.iter_smooth.api import iter_smooth_impl_non_fusion_linear

    gen = torch.Generator().manual_seed(seed)
    for group in groups:
        try:
            linears = [model.get_submodule(name) for name in group]
        except AttributeError as exc:
            raise ValueError(
                f"Smooth group {group}: no such Linear in the original Wan tree ({exc})"
            ) from None
        k = linears[0].in_features
        if maxima is None:
            act_amax = (torch.rand(k, generator=gen) * 8 + 0.05).to(torch.bfloat16)
        else:
            act_amax = _calibrated(maxima, group, k)
        context = IterSmoothContext(version=1, a_smooth_scale=act_amax, shift=None)
        scales = iter_smooth_impl_non_fusion_linear(
            NonFusionSubgraph(linears=linears, linear_names=group), IterSmoothConfig(), context
        )
        for linear in linears:
            hook = NonFusionSmoothQuantHookIR(scales)
            hook.set_hook_handle(linear.register_forward_pre_hook(hook))


def _top_level_requests(model: nn.Module) -> list:
    """One msModelSlim ``BatchProcessRequest`` per top-level module and per block, as its runner makes."""
    from msmodelslim.core.base.protocol import BatchProcessRequest

    requests = [BatchProcessRequest(name=n, module=m) for n, m in model.named_children() if n != "blocks"]
    return requests + [BatchProcessRequest(name=f"blocks.{i}", module=b) for i, b in enumerate(model.blocks)]


def _svd_residual(model: nn.Module, spec: ExpertSpec) -> None:
    """msModelSlim's ``svd_res`` processor over ``spec.svd``: each matched Linear's weight becomes the
    residual ``W - L2 @ L1`` and gets a pre-hook that the quantizer turns into its SVD wrapper."""
    from msmodelslim.processor.svd_residual.processor import (
        SVDResidualProcessor,
        SVDResidualProcessorConfig,
    )

    processor = SVDResidualProcessor(
        model, SVDResidualProcessorConfig(rank=spec.svd_rank, include=spec.svd, exclude=[])
    )
    for request in _top_level_requests(model):
        processor.preprocess(request)
        processor.process(request)
        processor.postprocess(request)
    processor.post_run()


def _calibrated(maxima: Mapping[str, torch.Tensor], group: list[str], k: int) -> torch.Tensor:
    """A Smooth group's input maxima from a calibration run: the Linears of a group share their input."""
    missing = [name for name in group if name not in maxima]
    if missing:
        raise ValueError(
            f"Smooth group {group}: the calibration maxima have no entry for {missing}; calibrate the "
            "same pipeline (vllm_omni_mxfp4_tiny.calibration.activation_maxima)"
        )
    amax = maxima[group[0]]
    if amax.shape != (k,) or not bool(torch.isfinite(amax).all()):
        raise ValueError(
            f"Smooth group {group}: calibration maxima of shape {tuple(amax.shape)}; expected {k} finite values"
        )
    return amax.clamp_min(1e-5).to(torch.bfloat16)


def _reference(module: nn.Module) -> LayerReference | None:
    import msmodelslim.ir as qir

    deployed, mul_scale, low_rank = module, None, None
    if isinstance(module, qir.SVDResidualWrapper):
        low_rank = (module.svd_lowrank_l1.detach().clone(), module.svd_lowrank_l2.detach().clone())
        module = module.wrapped_module
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
    return LayerReference(values, mul_scale, low_rank, deployed)


def _adapter(model_path: Path):
    """A minimal msModelSlim model adapter: the savers read ``model_path`` (and AscendV1 checks IModel)."""
    from msmodelslim.model import IModel

    class Adapter(IModel):
        model_type = property(lambda self: "Wan2_2")
        model_path = property(lambda self: model_path)
        trust_remote_code = property(lambda self: False)

    return Adapter()


def _save(model: nn.Module, requests: list, save_dir: Path, spec: ExpertSpec, model_path: Path) -> None:
    """Run msModelSlim's saver of ``spec`` over the quantized model, into ``save_dir``."""
    from msmodelslim.core.quant_service.modelslim_v1.save.ascendv1 import AscendV1Config, AscendV1Saver
    from msmodelslim.core.quant_service.modelslim_v1.save.mindie_format import (
        MindIEFormatConfig,
        MindIEFormatSaver,
    )
    from msmodelslim.core.quant_service.modelslim_v1.save.utils.safetensors import (
        ONE_GB_FILE_BYTES,
        BufferedSafetensorsWriter,
    )
    from msmodelslim.utils.logging import logger as msmodelslim_logger

    if spec.saver == "mindie":
        saver = MindIEFormatSaver(
            model, MindIEFormatConfig(save_directory=str(save_dir), part_file_size=0), _adapter(model_path)
        )
        prefix = "quant_model_weight"
    else:
        saver = AscendV1Saver(
            model, AscendV1Config(save_directory=str(save_dir), part_file_size=0), _adapter(model_path)
        )
        prefix = "quant_model_weights"
    if spec.shard_bytes:
        saver.safetensors_writer = BufferedSafetensorsWriter(
            logger=msmodelslim_logger,
            max_gb_size=spec.shard_bytes / ONE_GB_FILE_BYTES,
            save_directory=str(save_dir),
            save_prefix=prefix,
        )
    for request in requests:
        saver.preprocess(request)
        saver.postprocess(request)
    saver.post_run()


def quantize_expert(
    diffusers_state: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    save_dir: str | Path,
    spec: ExpertSpec,
    *,
    seed: int = 0,
    maxima: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, LayerReference]:
    """Quantize one expert with msModelSlim and save its export into ``save_dir`` (new or empty).

    ``diffusers_state`` and ``config`` are the expert's diffusers weights and ``config.json``.
    ``maxima``: calibrated per-channel input maxima by original Linear name
    (:func:`vllm_omni_mxfp4_tiny.calibration.activation_maxima`); without them the Smooth factors
    stand on synthetic maxima seeded with ``seed``.
    Returns, by ORIGINAL layer name, what msModelSlim quantized (for validating a merge).
    """
    require_msmodelslim()
    from msmodelslim.processor.quant.linear import LinearProcessorConfig, LinearQuantProcessor

    save_dir = Path(save_dir)
    if save_dir.exists() and (not save_dir.is_dir() or any(save_dir.iterdir())):
        raise FileExistsError(f"msModelSlim export directory {save_dir} exists and is not empty")
    model = original_model(diffusers_state, config)
    if spec.svd:
        _svd_residual(model, spec)
    _smooth(model, spec.smooth, seed, maxima)
    quant = LinearQuantProcessor(
        model, LinearProcessorConfig(qconfig=_qconfig(spec.fmt), include=["*"], exclude=spec.exclude)
    )
    requests = _top_level_requests(model)
    for request in requests:
        quant.preprocess(request)
        quant.postprocess(request)
    quant.post_run()
    references = {}
    for name, module in model.named_modules():
        ref = _reference(module)
        if ref is not None and not name.endswith(".wrapped_module"):
            references[name] = ref

    save_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="msmodelslim-model-path-") as model_path:
        # The savers read the model's config.json from the adapter's model_path.
        source = Path(model_path)
        (source / "config.json").write_text(json.dumps({"model_type": "t2v", "dim": model.dim}))
        _save(model, requests, save_dir, spec, source)
    logger.info(
        "msModelSlim quantized %d Linears (%s, %d Smooth groups) into %s",
        len(references),
        spec.fmt,
        len(spec.smooth),
        save_dir,
    )
    return references


def load_transformer(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The diffusers weights (all ``*.safetensors`` shards) and ``config.json`` of a transformer folder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: missing; expected a diffusers transformer folder")
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(shard)))
    return state, json.loads(config_path.read_text())


def pipeline_transformers(original_model: str | Path) -> tuple[str, ...]:
    """The transformer folders ``model_index.json`` lists (``transformer`` and maybe ``transformer_2``)."""
    index_path = Path(original_model) / "model_index.json"
    try:
        index = json.loads(index_path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{index_path}: missing; expected a diffusers pipeline directory") from None
    names = tuple(
        key
        for key in ("transformer", "transformer_2")
        if isinstance(index.get(key), list) and index[key] and index[key][0] is not None
    )
    if not names:
        raise ValueError(f"{index_path}: lists no transformer")
    return names


def export_pipeline(
    original_model: str | Path,
    save_path: str | Path,
    specs: Mapping[str, ExpertSpec] | None = None,
    *,
    seed: int = 0,
    maxima: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
) -> dict[str, dict[str, LayerReference]]:
    """Quantize every transformer of a diffusers Wan2.2 pipeline with msModelSlim into ``save_path``.

    ``save_path`` must not exist; it gets ``high_noise_model/`` and ``low_noise_model/`` for a
    two-expert pipeline, or the single expert's files at its root. ``specs`` maps transformer
    folders to :class:`ExpertSpec` (default: :func:`default_specs`). ``maxima``: each folder's
    calibrated input maxima (:func:`vllm_omni_mxfp4_tiny.calibration.activation_maxima`); without
    them expert ``i`` uses synthetic Smooth statistics seeded with ``seed + i``. Returns each
    folder's :func:`quantize_expert` references.
    """
    require_msmodelslim()
    original_model, save_path = Path(original_model), Path(save_path)
    if save_path.exists():
        raise FileExistsError(f"msModelSlim export directory {save_path} already exists")
    experts = pipeline_transformers(original_model)
    loaded = {name: load_transformer(original_model / name) for name in experts}
    if specs is None:
        specs = default_specs(int(loaded[experts[0]][1]["num_layers"]), experts)
    unknown = sorted(set(specs) - set(experts))
    if unknown:
        raise ValueError(f"specs name transformers {unknown} that {original_model} does not have ({experts})")
    uncalibrated = sorted(set(specs) - set(maxima)) if maxima is not None else []
    if uncalibrated:
        raise ValueError(
            f"maxima has no calibration for {uncalibrated} of {original_model}; calibrate every expert"
        )
    save_path.mkdir(parents=True)
    references = {}
    for i, name in enumerate(experts):
        if name not in specs:
            continue
        target = save_path / EXPERT_FOLDERS[name] if len(experts) == 2 else save_path
        state, config = loaded[name]
        expert_maxima = None if maxima is None else maxima[name]
        references[name] = quantize_expert(
            state, config, target, specs[name], seed=seed + i, maxima=expert_maxima
        )
    return references
