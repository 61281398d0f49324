"""msModelSlim's shipped Wan2.2 MXFP4 recipes, run unedited on a diffusers Wan2.2 pipeline on the CPU.

msModelSlim 26.1 ships ``lab_practice/wan2_2/wan2_2_w4a4f4_mxfp_t2v.yaml`` and
``wan2_2_w4a4f8_mxfp_t2v.yaml`` (blocks 0-4 W8A8 MXFP8, the other blocks W4A4 MXFP4 with ``ceil_x``
weights, ``online_quarot`` on the self-attention, ``fa3_quant``). :func:`run_recipe` runs one of them
the way ``msmodelslim quant --model_type Wan2.2-T2V-A14B`` does: the YAML through
``MultimodalSDModelslimV1QuantConfig``, each expert through ``LayerWiseRunner`` with the recipe's
processors and saver, driven by the real ``Wan2_2T2VModelAdapter``.

What is replaced, and why (everything else is msModelSlim's own code):

- the adapter's ``_check_import_dependency``, ``configure_runtime`` and ``init_model`` import the Wan2.2
  repository and MindIE-SD and build ``wan.WanT2V`` on a device: here the experts are built on the CPU
  from the diffusers weights (:func:`repo_model`) and bound to the adapter as ``init_model`` does;
- ``_quantization_context_with_no_sync`` moves modules to ``'npu'`` and enters CUDA autocast: here it
  is ``torch.no_grad()``;
- the runner keeps the quantized blocks on the CPU (``offload_device='cpu'``) instead of the meta
  device, so that msModelSlim's in-memory quantized model stays available as the reference.

The adapter finds its targets by class name and FA3 looks up ``rope_apply`` and ``attention`` in the
module that defines the attention's ``forward``, so the stand-in classes below carry the Wan
repository's names. The recipes are data-free (``enable_dump: False``): the stand-ins are never run,
and their ``forward`` raises.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .cache import cache_root, content_key, files_digest
from .msmodelslim_export import (
    EXPERT_FOLDERS,
    OriginalWan,
    collections_skip_older_objects,
    load_transformer,
    original_name,
    pipeline_transformers,
    require_msmodelslim,
)

logger = logging.getLogger(__name__)

#: Recipe key -> the YAML under msModelSlim's ``lab_practice/``.
RECIPES = {
    "w4a4f4": "wan2_2/wan2_2_w4a4f4_mxfp_t2v.yaml",
    "w4a4f8": "wan2_2/wan2_2_w4a4f8_mxfp_t2v.yaml",
}
#: Recipe key -> a YAML of this package's ``recipes/`` (msModelSlim does not ship one for it): svd_res
#: rank 16 then W4A4 MXFP4 on every block Linear, ascendv1 saver.
OWN_RECIPES = {"svd16": "wan2_2_w4a4_mxfp4_svd16_t2v.yaml"}
#: The recipes name blocks 0-4 (W8A8 MXFP8); a model needs more blocks for their W4A4 MXFP4 rule.
MXFP8_BLOCKS = 5
MODEL_TYPE = "Wan2.2-T2V-A14B"
# Bump when the way the recipes are run changes in a way the cache key does not capture.
_RUNNER_VERSION = 1
_DONE = "done"


def rope_apply(x: torch.Tensor, *args: Any) -> torch.Tensor:
    """Stand-in for ``wan.modules.model.rope_apply``; FA3 only looks it up (the export is data-free)."""
    raise NotImplementedError("the stand-in Wan model is never run; the recipes are data-free")


class _WanRMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class WanSelfAttention(nn.Module):
    """The Wan repository's self-attention parameters and the attributes msModelSlim reads."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.window_size = num_heads, dim // num_heads, (-1, -1)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = _WanRMSNorm(dim), _WanRMSNorm(dim)

    def attention(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("the stand-in Wan model is never run; the recipes are data-free")

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("the stand-in Wan model is never run; the recipes are data-free")


class WanCrossAttention(WanSelfAttention):
    """The Wan repository's cross-attention (same parameters)."""


class WanAttentionBlock(nn.Module):
    """One Wan block under the repository's names (the runner visits ``*AttentionBlock`` classes)."""

    def __init__(self, dim: int, ffn_dim: int, num_heads: int):
        super().__init__()
        self.self_attn = WanSelfAttention(dim, num_heads)
        self.norm3 = nn.LayerNorm(dim, elementwise_affine=True)
        self.cross_attn = WanCrossAttention(dim, num_heads)
        self.ffn = nn.Sequential(
            nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim)
        )
        self.modulation = nn.Parameter(torch.zeros(1, 6, dim))


def repo_model(diffusers_state: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> nn.Module:
    """The original Wan tree with the repository's class names, holding exactly the diffusers weights."""
    model = OriginalWan(config)
    heads = int(config["num_attention_heads"])
    model.blocks = nn.ModuleList(
        WanAttentionBlock(model.dim, int(config["ffn_dim"]), heads) for _ in range(int(config["num_layers"]))
    )
    model.num_heads = heads
    model = model.to(torch.bfloat16)
    state = {original_name(k): v for k, v in diffusers_state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            "the diffusers transformer does not map onto the Wan repository tree: "
            f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}"
        )
    return model


def _cpu_adapter(model_dir: Path, experts: dict[str, nn.Module]):
    """The real ``Wan2_2T2VModelAdapter`` with only its NPU / Wan-repository steps replaced."""
    from msmodelslim.core.const import DeviceType
    from msmodelslim.model.wan2_2.t2v.model_adapter import Wan2_2T2VModelAdapter

    class CpuAdapter(Wan2_2T2VModelAdapter):
        def _check_import_dependency(self):
            pass

        def configure_runtime(self, inference_config):
            self.model_args = types.SimpleNamespace(param_dtype=torch.bfloat16)

        def init_model(self, device=DeviceType.CPU):
            self._bind_expert_sub_adapters(experts)
            return experts

        @contextlib.contextmanager
        def _quantization_context_with_no_sync(self, *models):
            with torch.no_grad():
                yield

    adapter = CpuAdapter(MODEL_TYPE, model_dir)
    adapter.configure_runtime(None)
    adapter.init_model()
    return adapter


def recipe_path(recipe: str) -> Path:
    """The YAML of ``recipe``: a key of :data:`RECIPES` (in the installed msModelSlim) or of
    :data:`OWN_RECIPES` (in this package)."""
    import msmodelslim

    if recipe in OWN_RECIPES:
        return Path(__file__).parent / "recipes" / OWN_RECIPES[recipe]
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; expected one of {', '.join([*RECIPES, *OWN_RECIPES])}")
    return Path(os.path.dirname(msmodelslim.__file__)) / "lab_practice" / RECIPES[recipe]


def _quantize(adapter, name: str, model: nn.Module, recipe: Path, save_dir: Path) -> None:
    """One expert through ``LayerWiseRunner`` with the recipe's processors and saver, as
    ``MultimodalSDModelslimV1QuantService._quantize_multi_expert_models`` does."""
    import yaml
    from msmodelslim.core.const import DeviceType
    from msmodelslim.core.quant_service.multimodal_sd_v1.quant_config import (
        MultimodalSDModelslimV1QuantConfig,
    )
    from msmodelslim.core.runner.layer_wise_runner import LayerWiseRunner

    config = MultimodalSDModelslimV1QuantConfig.model_validate(yaml.safe_load(recipe.read_text()))
    sub = adapter.get_expert_adapter(name)
    save_dir.mkdir(parents=True)
    for saver in config.spec.save:
        saver.set_save_directory(save_dir)
    runner = LayerWiseRunner(adapter=sub, offload_device="cpu")
    for processor in [*config.spec.process, *config.spec.save]:
        runner.add_processor(processor_cfg=processor)
    with sub.quantization_context(), collections_skip_older_objects():
        runner.run(calib_data=None, device=DeviceType.CPU, model=model)


def run_recipe(recipe: str, original_model: str | Path, save_path: str | Path) -> dict[str, nn.Module]:
    """Run shipped recipe ``recipe`` on the two-expert diffusers pipeline ``original_model``.

    Writes ``high_noise_model/`` and ``low_noise_model/`` under ``save_path`` (which must not exist) and
    returns msModelSlim's in-memory quantized models by diffusers transformer folder.
    """
    require_msmodelslim()
    original_model, save_path = Path(original_model), Path(save_path)
    if save_path.exists():
        raise FileExistsError(f"msModelSlim export directory {save_path} already exists")
    folders = pipeline_transformers(original_model)
    if folders != tuple(EXPERT_FOLDERS):
        raise ValueError(f"{original_model}: the Wan2.2 T2V recipes need two experts, found {folders}")
    experts, by_folder = {}, {}
    for folder in folders:
        state, config = load_transformer(original_model / folder)
        if int(config["num_layers"]) <= MXFP8_BLOCKS:
            logger.warning(
                "%s: %s blocks, so every block is W8A8 MXFP8 under this recipe", folder, config["num_layers"]
            )
        by_folder[folder] = experts[EXPERT_FOLDERS[folder]] = repo_model(state, config)
    save_path.mkdir(parents=True)
    model_dir = save_path / ".model"
    model_dir.mkdir()
    adapter = _cpu_adapter(model_dir, experts)
    for name, model in experts.items():
        _quantize(adapter, name, model, recipe_path(recipe), save_path / name)
    model_dir.rmdir()
    logger.info("msModelSlim recipe %s written to %s", recipe, save_path)
    return by_folder


def quantized_linears(model: nn.Module) -> dict[str, nn.Module]:
    """msModelSlim's deployed fake-quant Linears of a quantized model, by original module name."""
    import msmodelslim.ir as qir

    kinds = (qir.W4A4MXDynamicPerBlockFakeQuantLinear, qir.W8A8MXDynamicPerBlockFakeQuantLinear)
    return {name: module for name, module in model.named_modules() if isinstance(module, kinds)}


def _scheme(scheme) -> dict[str, Any]:
    return {"dtype": scheme.dtype.name, "scope": scheme.scope.name, "symmetric": scheme.symmetric}


def _saved(module: nn.Module) -> dict[str, Any]:
    """What msModelSlim's constructor needs to rebuild one of its fake-quant Linears (the modules
    themselves do not pickle: their format descriptors are classes made at run time)."""
    return {
        "class": type(module).__name__,
        "x": {**_scheme(module.x_scheme), "axes": module.x_axes},
        "w": {**_scheme(module.w_scheme), "axes": module.w_axes},
        "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
    }


def _rebuilt(saved: dict[str, Any]) -> nn.Module:
    """A fake-quant Linear built by msModelSlim's own constructor from :func:`_saved` data."""
    import msmodelslim.ir as qir
    from msmodelslim.ir.qal import QDType, QParam, QScheme, QScope, QStorage

    def scheme(fields: dict[str, Any]) -> QScheme:
        return QScheme(
            dtype=QDType[fields["dtype"]], scope=QScope[fields["scope"]], symmetric=fields["symmetric"]
        )

    state = saved["state"]
    x = QParam(scheme=scheme(saved["x"]), ext={"axes": saved["x"]["axes"]})
    ext = {"axes": saved["w"]["axes"], "scale": state["weight_scale"], "offset": state.get("weight_offset")}
    w = QParam(scheme=scheme(saved["w"]), ext=ext)
    storage = QStorage(QDType[saved["w"]["dtype"]], state["weight"])
    return getattr(qir, saved["class"])(x, w, storage, state.get("bias"))


def _weights_digest(original_model: Path, folders: tuple[str, ...]) -> dict[str, str]:
    """A hash of each transformer's weight files (the cache key follows the weights, not the path)."""
    return {folder: files_digest(original_model / folder, "*.safetensors") for folder in folders}


def cached_recipe_export(
    recipe: str, original_model: str | Path, *, cache_dir: str | Path | None = None
) -> tuple[Path, dict[str, dict[str, nn.Module]]]:
    """:func:`run_recipe` once per content (recipe YAML, msModelSlim version, original weights), cached
    under ``msmodelslim_recipes/`` of the tiny-model cache: the export directory and msModelSlim's
    quantized Linears (:func:`quantized_linears`) by transformer folder."""
    import msmodelslim

    original_model = Path(original_model)
    key = content_key(
        {
            "recipe": recipe,
            "yaml": hashlib.sha256(recipe_path(recipe).read_bytes()).hexdigest(),
            "msmodelslim": getattr(msmodelslim, "__version__", "unknown"),
            "weights": _weights_digest(original_model, pipeline_transformers(original_model)),
            "runner": _RUNNER_VERSION,
        }
    )
    final = cache_root("msmodelslim_recipes", cache_dir) / f"wan22_{recipe}_{key}"
    if not (final / _DONE).is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".staging-{final.name}-", dir=final.parent))
        try:
            models = run_recipe(recipe, original_model, staging / "export")
            linears = {
                folder: {name: _saved(m) for name, m in quantized_linears(model).items()}
                for folder, model in models.items()
            }
            torch.save(linears, staging / "linears.pt")
            (staging / _DONE).write_text(recipe + "\n")
            with contextlib.suppress(OSError):  # another process may have finished the same build first
                os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    saved = torch.load(final / "linears.pt", weights_only=False)
    return final / "export", {
        folder: {name: _rebuilt(data) for name, data in linears.items()} for folder, linears in saved.items()
    }
