"""Tiny peft LoRA adapters for the tiny two-expert Wan2.2 pipeline (``build_tiny_wan(2)``).

An adapter is what vLLM-Omni's ``peft`` LoRA backend loads: a directory with ``adapter_config.json``
(rank, alpha, target modules) and ``adapter_model.safetensors`` with one
``base_model.model.<module>.lora_A.weight`` ``(r, K)`` and ``...lora_B.weight`` ``(N, r)`` pair per
module, named as vLLM-Omni's runtime names the module (not diffusers' names). Its keys carry no
component prefix, so each pair binds to that module in both experts (``transformer`` and
``transformer_2``).

:func:`write_adapter` targets every Linear of every block that our methods quantize
(:data:`BLOCK_TARGETS`). The runtime fuses self-attention's Q, K and V into one ``attn1.to_qkv``;
the adapter holds them as three modules (``attn1.to_q``, ``attn1.to_k``, ``attn1.to_v``,
:data:`QKV_SLICES`), which vLLM-Omni binds to the three output slices of the fused layer.

The pairs are random (a seed), scaled against the model: each module's ``B @ A`` has an RMS of
``strength`` times the RMS of the base weight it adds to, so the adapter changes every layer's
output by about that fraction, whatever the tiny model's weight scale is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

#: The quantized Linears of one Wan2.2 block, by runtime name, with the fused QKV as its three slices.
BLOCK_TARGETS = (
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out",
    "attn2.to_q",
    "attn2.to_k",
    "attn2.to_v",
    "attn2.to_out",
    "ffn.net_0.proj",
    "ffn.net_2",
)
#: The default strength (see :func:`write_adapter`): the adapter's effect on the tiny model's frames is
#: then several times the MXFP4 quantization error (tests/omni/test_lora.py measures both), while the
#: frames stay close to the base model's (a changed video, not noise).
STRENGTH = 2.0
#: The slices of the fused ``attn1.to_qkv``.
QKV_SLICES = ("attn1.to_q", "attn1.to_k", "attn1.to_v")
#: Runtime name -> diffusers checkpoint name, where they differ (to read the base weight).
_CHECKPOINT_NAMES = {
    "attn1.to_out": "attn1.to_out.0",
    "attn2.to_out": "attn2.to_out.0",
    "ffn.net_0.proj": "ffn.net.0.proj",
    "ffn.net_2": "ffn.net.2",
}


def adapter_modules(model: Path, targets: Iterable[str] = BLOCK_TARGETS) -> list[str]:
    """The adapter's module names for ``targets`` in every block of ``model``'s ``transformer``,
    block by block (``blocks.0.attn1.to_q``, ...)."""
    blocks = json.loads((Path(model) / "transformer" / "config.json").read_text())["num_layers"]
    targets = list(targets)
    return [f"blocks.{b}.{t}" for b in range(blocks) for t in targets]


def write_adapter(
    model: Path,
    out: Path,
    *,
    seed: int,
    rank: int = 4,
    strength: float = STRENGTH,
    targets: Iterable[str] = BLOCK_TARGETS,
) -> Path:
    """Write a peft LoRA adapter for ``model`` (the tiny Wan2.2 pipeline) into ``out``; returns ``out``.

    One pair per module of :func:`adapter_modules`: ``A`` is standard normal over ``sqrt(K)``, ``B``
    normal with the spread that gives ``B @ A`` an RMS of ``strength`` times the RMS of the module's
    weight in ``model``'s ``transformer`` (both experts have the same shapes). ``lora_alpha`` equals
    ``rank``, so peft's scaling is 1. The pairs are drawn from ``seed`` for every module of
    :data:`BLOCK_TARGETS` in order and then restricted to ``targets``: an adapter of a subset holds
    exactly the tensors the full adapter of the same seed holds for those modules. BF16, as the
    engine runs them.
    """
    model, out, targets = Path(model), Path(out), tuple(targets)
    wanted = set(adapter_modules(model, targets))
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    path = model / "transformer" / "diffusion_pytorch_model.safetensors"
    with safe_open(str(path), "pt") as weights:
        for module in adapter_modules(model):
            block, _, target = module.partition(".")[2].partition(".")
            name = f"blocks.{block}.{_CHECKPOINT_NAMES.get(target, target)}.weight"
            weight = weights.get_tensor(name).float()
            n, k = weight.shape
            rms = float(weight.pow(2).mean().sqrt())
            lora_a = torch.randn(rank, k, generator=generator) / math.sqrt(k)
            # Var((B @ A)_ij) = rank * Var(B) / K; solve for RMS(B @ A) = strength * RMS(W).
            lora_b = torch.randn(n, rank, generator=generator) * (strength * rms * math.sqrt(k / rank))
            if module in wanted:
                tensors[f"base_model.model.{module}.lora_A.weight"] = lora_a.to(torch.bfloat16)
                tensors[f"base_model.model.{module}.lora_B.weight"] = lora_b.to(torch.bfloat16)
    if not tensors:
        raise ValueError(f"no adapter module matches {sorted(targets)}")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": sorted(set(targets)),
        "bias": "none",
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
