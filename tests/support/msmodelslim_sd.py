"""Running msModelSlim's diffusion quantization service on a tiny model on the CPU, and reading its
quantized model back: shared by the per-adapter export helpers (``flux1_export.py``, ...).

:func:`run_service` runs ``MultimodalSDModelslimV1QuantService.quant_process`` (argument parsing,
``init_model``, ``LayerWiseRunner`` with the recipe's processors, the recipe's saver) with the
adapter given; its runner offloads finished blocks to the CPU instead of the meta device, so that
msModelSlim's quantized model stays in memory as the reference. :func:`deployed_weight` reads the
weight msModelSlim's own fake-quant Linear multiplies by (its forward, with ``F.linear`` captured).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from vllm_omni_mxfp4_tiny.msmodelslim_export import collections_skip_older_objects

#: The quantizer settings of the user guide's two MXFP4 forms (per qconfig: act and weight).
SINGLE_SCALE = {
    "act": {"scope": "per_block", "dtype": "mxfp4", "symmetric": True, "method": "minmax"},
    "weight": {"scope": "per_block", "dtype": "mxfp4", "symmetric": True, "method": "minmax"},
}
_DUAL = {"scope": "dual_scale", "dtype": "mxfp4", "symmetric": True, "method": "dualscale"}
DUAL_SCALE = {
    "act": {**_DUAL, "ext": {"dual_block_size": 512}},
    "weight": {**_DUAL, "ext": {"dual_block_size": 512}},
}
QCONFIGS = {"mxfp4": SINGLE_SCALE, "mxfp4_dualscale": DUAL_SCALE}


def recipe(method: str, include: list[str], model_config: dict) -> dict:
    """An msModelSlim ``multimodal_sd_modelslim_v1`` config: one ``linear_quant`` step of ``method``
    (``mxfp4`` or ``mxfp4_dualscale``) over ``include``, the MindIE saver, no calibration dump."""
    return {
        "apiversion": "multimodal_sd_modelslim_v1",
        "spec": {
            "process": [{"type": "linear_quant", "qconfig": QCONFIGS[method], "include": include}],
            "save": [{"type": "mindie_format_saver", "part_file_size": 0}],
            "multimodal_sd_config": {"dump_config": {"enable_dump": False}, "model_config": model_config},
        },
    }


def run_service(config: dict, adapter, save_path: Path) -> None:
    """msModelSlim's service with ``config`` (a dict of the YAML form) and ``adapter`` on the CPU,
    saved to ``save_path`` (created); the quantized model stays on ``adapter.transformer``."""
    from msmodelslim.core.const import DeviceType
    from msmodelslim.core.context.context_factory import ContextFactory
    from msmodelslim.core.quant_service.multimodal_sd_v1 import quant_service
    from msmodelslim.core.quant_service.multimodal_sd_v1.quant_config import (
        MultimodalSDModelslimV1QuantConfig,
    )
    from msmodelslim.core.quant_service.multimodal_sd_v1.quant_service import (
        MultimodalSDModelslimV1QuantService,
    )

    validated = MultimodalSDModelslimV1QuantConfig.model_validate(config)
    save_path.mkdir(parents=True)
    service = MultimodalSDModelslimV1QuantService(None, None, ContextFactory())
    cwd = os.getcwd()
    runner = quant_service.LayerWiseRunner
    try:  # the adapter's argument parsing creates its default output_dir in the working directory
        os.chdir(save_path.parent)
        quant_service.LayerWiseRunner = functools.partial(runner, offload_device="cpu")
        with collections_skip_older_objects():  # the runner's gc.collect() per processor
            service.quant_process(validated, adapter, save_path, DeviceType.CPU)
    finally:
        quant_service.LayerWiseRunner = runner
        os.chdir(cwd)


def quantized_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """msModelSlim's deployed W4A4 MXFP4 fake-quant Linears (either form), by module name."""
    from msmodelslim.ir import W4A4MXDynamicDualScaleFakeQuantLinear
    from msmodelslim.ir.w4a4_mx_dynamic import W4A4MXDynamicPerBlockFakeQuantLinear

    kinds = (W4A4MXDynamicDualScaleFakeQuantLinear, W4A4MXDynamicPerBlockFakeQuantLinear)
    return {n: m for n, m in model.named_modules() if isinstance(m, kinds)}


def deployed_weight(module: torch.nn.Module) -> torch.Tensor:
    """The weight msModelSlim's fake-quant Linear multiplies by: its forward, with F.linear captured."""
    import msmodelslim.ir.w4a4_mx_dynamic as single
    import msmodelslim.ir.w4a4_mx_dynamic_dualscale as dual

    seen = {}

    class _Capture:
        def __getattr__(self, name):
            return getattr(torch.nn.functional, name)

        @staticmethod
        def linear(x, weight, bias=None):
            seen["weight"] = weight.detach().clone()
            return x @ weight.to(x.dtype).T

    saved = single.F, dual.F
    single.F = dual.F = _Capture()
    try:
        with torch.no_grad():
            module(torch.ones(1, module.weight.shape[-1], dtype=torch.float32))
    finally:
        single.F, dual.F = saved
    return seen["weight"]


def build_engine_transformer(env, pipeline_dir: Path, cls: type) -> torch.nn.Module:
    """vLLM-Omni's transformer ``cls`` as its pipelines build it (the constructor arguments from
    ``transformer/config.json``, the quantization config vLLM-Omni builds from its
    ``quantization_config``, none for a BF16 original), loaded from ``pipeline_dir`` by vLLM-Omni's
    own loader (with this package's load checks), under the ``vllm_env`` fixture."""
    import json

    from vllm.config import LoadConfig
    from vllm_omni.diffusion.data import TransformerConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader
    from vllm_omni.diffusion.utils.tf_utils import get_transformer_config_kwargs
    from vllm_omni.quantization import build_quant_config

    config = json.loads((pipeline_dir / "transformer" / "config.json").read_text())
    quant = config.pop("quantization_config", None)
    env.od_config.tf_model_config = TransformerConfig(params=config)
    kwargs = get_transformer_config_kwargs(env.od_config.tf_model_config, cls)
    with env.context():
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = cls(
                od_config=env.od_config, quant_config=build_quant_config(quant) if quant else None, **kwargs
            )
        finally:
            torch.set_default_dtype(old)
        source = DiffusersPipelineLoader.ComponentSource(
            model_or_path=str(pipeline_dir), subfolder="transformer", revision=None
        )
        model.weights_sources = [source]
        loader = DiffusersPipelineLoader(LoadConfig(), env.od_config)
        loader.load_weights(model)
        loader._process_weights_after_loading(model, torch.device("cpu"))
    return model.eval()


def running_mx_layers(model: torch.nn.Module) -> list[str]:
    """The Linears of a loaded vLLM-Omni model that run this package's MXFP4 method, sorted."""
    from vllm_omni_mxfp4.omni.linear import MxLinearMethod

    return sorted(
        n for n, m in model.named_modules() if isinstance(getattr(m, "quant_method", None), MxLinearMethod)
    )


def stand_in_components(root: Path, components: dict[str, str], seed: int) -> None:
    """Small stand-in component folders (``folder -> weights file name``) and a scheduler config: the
    merge copies them byte for byte; nothing here loads them."""
    import json

    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed + 100)
    for folder, weights in components.items():
        (root / folder).mkdir()
        (root / folder / "config.json").write_text(json.dumps({"_class_name": folder, "seed": seed}))
        save_file({"w": torch.randn(64, 32, generator=gen)}, str(root / folder / weights))
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": "FlowMatchEulerDiscreteScheduler"})
    )


#: The E2M1 value of each 4-bit code (OCP MX spec, table of FP4 E2M1), written out.
E2M1 = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float64,
)


def decode(tensors: dict[str, torch.Tensor], layer: str) -> torch.Tensor:
    """A merged MXFP4 layer's weight as float64 numbers (written independently of the package): E2M1
    codes, even element in the low nibble, times 2^(E8M0 - 127) per 32 along K, and for DualScale
    times the float32 ``weight_dual_scale`` per 512."""
    packed = tensors[f"{layer}.weight"]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    scale = torch.exp2(tensors[f"{layer}.weight_scale"].double() - 127).repeat_interleave(32, dim=1)
    weight = E2M1[codes] * scale[:, : codes.shape[1]]
    dual = tensors.get(f"{layer}.weight_dual_scale")
    if dual is None:
        return weight
    dual = dual.double().reshape(packed.shape[0], -1)
    return weight * dual.repeat_interleave(512, dim=1)[:, : codes.shape[1]]


def merged_transformer(directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A merged pipeline's ``transformer/`` tensors and ``config.json``."""
    import json

    from safetensors.torch import load_file

    tensors = {}
    for path in sorted((directory / "transformer").glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors, json.loads((directory / "transformer" / "config.json").read_text())
