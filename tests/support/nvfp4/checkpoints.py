"""Checkpoint directories for the NVFP4 tests: small detection inputs (tensors, configs, header
metadata), model directories around the ModelOpt fixtures (and variants built from them), the
expected MXFP4 bytes from the independent reference, and the Wan expert built through the pipeline."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.support.nvfp4 import reference
from tests.support.nvfp4.producers.compressed import nvfp4_pipeline  # noqa: F401 (the tests' import path)
from vllm_omni_mxfp4.formats.nvfp4 import dequantize_nvfp4
from vllm_omni_mxfp4.sources.nvfp4 import detect_nvfp4, load_nvfp4_weight


def write_checkpoint(
    path: Path,
    tensors: dict[str, torch.Tensor],
    quantization_config: dict[str, Any] | None = None,
    metadata: dict[str, str] | None = None,
    hf_quant_config: dict[str, Any] | None = None,
) -> Path:
    """A diffusers-like component directory: one safetensors file, config.json, optional nested config."""
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata)
    config: dict[str, Any] = {"_class_name": "WanTransformer3DModel"}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, default=str))
    if hf_quant_config is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(hf_quant_config))
    return path


MODELOPT_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "modelopt"
"""ModelOpt exports of the tiny diffusers Wan2.2 transformer (``producers/modelopt_export.py``)."""


def model_dir_with(tmp: Path, fixture: str, sub: str = "transformer") -> Path:
    """A model directory whose ``sub`` component is a copy of the ModelOpt fixture ``fixture``."""
    import shutil

    root = tmp / f"{fixture}-model"
    shutil.copytree(MODELOPT_FIXTURES / fixture, root / sub)
    return root


def build_via_pipeline(env: Any, model_dir: Path, spec: Any, sub: str = "transformer") -> Any:
    """vLLM-Omni's Wan2.2 expert ``sub`` built through the T2V pipeline's ``_create_transformer`` (with
    this package's wrappers) for quantization ``spec``, and loaded by vLLM-Omni's own loader."""
    from types import SimpleNamespace

    from vllm.config import LoadConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader
    from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2 import Wan22Pipeline, load_transformer_config
    from vllm_omni.quantization import build_quant_config

    od_config = SimpleNamespace(
        model=str(model_dir),
        quantization_config=build_quant_config(spec) if spec is not None else None,
        quantization_config_is_auto_detected=False,
    )
    pipeline = SimpleNamespace(od_config=od_config, has_transformer_2=False)
    cfg = load_transformer_config(str(model_dir), sub)
    with env.context():
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = Wan22Pipeline._create_transformer(pipeline, cfg, sub)
        finally:
            torch.set_default_dtype(old)
        model.weights_sources = [
            DiffusersPipelineLoader.ComponentSource(
                model_or_path=str(model_dir), subfolder=sub, revision=None
            )
        ]
        loader = DiffusersPipelineLoader(LoadConfig(), env.od_config)
        loader.load_weights(model)
        loader._process_weights_after_loading(model, torch.device("cpu"))
    return model.eval()


# ------------------------------------------------------------------- expected values, independently


def reference_values(tensors: dict[str, torch.Tensor], layer: str) -> np.ndarray:
    """float32 ``(N, K)`` exact dequant (``fl(q * s * g)``) of a stored, row-major NVFP4 layer, element
    by element with :mod:`tests.support.nvfp4.reference` (no code of the package)."""
    codes = tensors[f"{layer}.weight"].numpy()
    scales = tensors[f"{layer}.weight_scale"].view(torch.uint8).numpy()
    g = float(tensors[f"{layer}.weight_scale_2"])
    n, half = codes.shape
    out = np.empty((n, half * 2), dtype=np.float32)
    for r in range(n):
        for j in range(half * 2):
            code = (codes[r, j // 2] >> (4 * (j % 2))) & 0xF
            out[r, j] = reference.nvfp4_element(int(code), int(scales[r, j // 16]), g, "exact")
    return out


def reference_mxfp4(values: np.ndarray, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed uint8 ``(N, K/2)`` (low nibble even) and E8M0 ``(N, K/32)`` of float32 ``values``
    requantized under ``rule`` by :mod:`tests.support.nvfp4.reference`."""
    n, k = values.shape
    codes = np.zeros((n, k), dtype=np.uint8)
    scales = np.zeros((n, k // 32), dtype=np.uint8)
    for r in range(n):
        for b in range(k // 32):
            block = [float(v) for v in values[r, b * 32 : (b + 1) * 32]]
            amax = max(abs(v) for v in block)
            code = reference.mse_code(block) if rule == "mse" else reference.RULE_CODES[rule](amax)
            scales[r, b] = code
            codes[r, b * 32 : (b + 1) * 32] = reference.mx_codes(block, code)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return torch.from_numpy(packed), torch.from_numpy(scales)


def fixture_tensors(fixture: str) -> dict[str, torch.Tensor]:
    """Every tensor of a ModelOpt fixture export."""
    from safetensors.torch import load_file

    return load_file(str(MODELOPT_FIXTURES / fixture / "diffusion_pytorch_model.safetensors"))


def variant(
    tmp: Path,
    fixture: str,
    *,
    config: Callable[[dict[str, Any]], None] | None = None,
    tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """A model directory holding a copy of ``fixture`` as its transformer, with ``config`` applied to
    its config.json dict and ``tensors`` to its tensors (each edits in place): bad inputs are built
    from a valid export."""
    root = model_dir_with(tmp, fixture)
    sub = root / "transformer"
    if config is not None:
        cfg = json.loads((sub / "config.json").read_text())
        config(cfg)
        (sub / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        stored = fixture_tensors(fixture)
        tensors(stored)
        save_file(stored, str(sub / "diffusion_pytorch_model.safetensors"), {"format": "pt"})
    return root


def pack_component(directory: Path) -> list[str]:
    """Pack every 2-D weight of the component in place with compressed-tensors (its own NVFP4
    packing and config); the packed layer names."""
    from tests.support.nvfp4.producers.compressed import ct_config, ct_layer

    [path] = sorted(directory.glob("*.safetensors"))
    tensors = load_file(str(path))
    packed = sorted(
        k[: -len(".weight")] for k, v in tensors.items() if k.endswith(".weight") and v.dim() == 2
    )
    for layer in packed:
        tensors.update({f"{layer}.{k}": v for k, v in ct_layer(tensors.pop(f"{layer}.weight")).items()})
    save_file(tensors, str(path), {"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = ct_config([])
    (directory / "config.json").write_text(json.dumps(config))
    return packed


def dequantized_copy(nvfp4: Path, dst: Path) -> Path:
    """A BF16 pipeline whose transformer holds the exact float32 dequant of each NVFP4 layer, rounded
    once to BF16 (the reference the converted checkpoint is compared with)."""
    shutil.copytree(nvfp4, dst)
    sub = dst / "transformer"
    [path] = sorted(sub.glob("*.safetensors"))
    stored = load_file(str(path))
    checkpoint = detect_nvfp4(sub)
    packed = {name: layer for name, layer in checkpoint.layers.items() if layer.action == "requantize"}
    out = {k: v for k, v in stored.items() if k.rpartition(".")[0] not in packed}
    for name, layer in packed.items():
        weight = load_nvfp4_weight(layer, lambda key: stored[key])
        out[f"{name}.weight"] = dequantize_nvfp4(weight).bfloat16()
        out.update({f"{name}.bias": stored[layer.tensors["bias"]]} if "bias" in layer.tensors else {})
    save_file(out, str(path), {"format": "pt"})
    config = json.loads((sub / "config.json").read_text())
    del config["quantization_config"]
    (sub / "config.json").write_text(json.dumps(config))
    return dst
