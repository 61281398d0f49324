"""NVFP4 checkpoints made by compressed-tensors itself, on the CPU: an NVFP4 source for the demo's
``nvfp4`` mode (served with ``quantization="mxfp4"``, requantized to MXFP4 while it loads) and for the
tests' NVFP4 checks.

Scales come from compressed-tensors' own observers' helpers (``generate_gparam``,
``calculate_qparams``) and the packing from ``NVFP4PackedCompressor.compress``: ``weight_packed``
(low nibble = even element), E4M3 ``weight_scale`` and the global scale stored as a divisor,
``weight_global_scale``. compressed-tensors comes with vLLM and is imported when used.

compressed-tensors packs slowly on the CPU (about 20 s for the trained tiny Wan2.2's 120 block
Linears on two cores), so :func:`cached_nvfp4_pipeline` keeps one copy per content (every file of
the source pipeline, the compressed-tensors version) in the tiny-model cache (:mod:`.cache`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from .cache import cache_root, cached_build, content_key, files_digest

_BUILDER_VERSION = 1


def _scheme():
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4

    return QuantizationScheme(targets=["Linear"], **NVFP4)


def ct_layer(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The compressed state dict of one Linear weight ``(N, K)``."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = _scheme()
    n, k = weight.shape
    g = generate_gparam(weight.min(), weight.max())
    groups = weight.reshape(n, k // 16, 16)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=g)
    state = {"weight": weight, "weight_scale": scale, "weight_global_scale": g}
    return dict(NVFP4PackedCompressor.compress(state, scheme))


def ct_config(ignore: list[str]) -> dict[str, Any]:
    """compressed-tensors' own ``quantization_config`` for an NVFP4 packed checkpoint."""
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(
        config_groups={"group_0": _scheme()},
        format="nvfp4-pack-quantized",
        quantization_status="compressed",
        ignore=ignore,
    )
    return json.loads(json.dumps(config.to_dict(), default=str))


def nvfp4_pipeline(src: Path, dst: Path) -> Path:
    """A copy of the diffusers Wan2.2 pipeline ``src`` at ``dst`` (new, or an empty directory) whose experts are NVFP4 checkpoints
    written by compressed-tensors: every 2-D weight of the blocks packed, the condition embedders and
    ``proj_out`` left in BF16 and listed in ``ignore`` (as NVFP4 recipes for Wan keep them)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    for sub in ("transformer", "transformer_2"):
        for path in sorted((dst / sub).glob("*.safetensors")):
            tensors = load_file(str(path))
            for key in [k for k in tensors if k.startswith("blocks.") and k.endswith(".weight")]:
                if tensors[key].dim() == 2:
                    tensors.update(
                        {f"{key[: -len('weight')]}{k}": v for k, v in ct_layer(tensors.pop(key)).items()}
                    )
            save_file(tensors, str(path), {"format": "pt"})
        config = json.loads((dst / sub / "config.json").read_text())
        config["quantization_config"] = ct_config(["re:condition_embedder.*", "proj_out"])
        (dst / sub / "config.json").write_text(json.dumps(config))
    return dst


def cached_nvfp4_pipeline(src: Path, *, cache_dir: str | Path | None = None) -> Path:
    """:func:`nvfp4_pipeline` of ``src``, built once per content under ``nvfp4_sources/`` of the
    tiny-model cache; returns the cached pipeline directory (read it, do not write into it)."""
    import compressed_tensors

    key = content_key(
        {
            "source": files_digest(Path(src)),
            "compressed_tensors": compressed_tensors.__version__,
            "builder": _BUILDER_VERSION,
        }
    )
    final = cache_root("nvfp4_sources", cache_dir) / f"{Path(src).name}_{key}"
    return cached_build(final, lambda staging: nvfp4_pipeline(Path(src), staging))
