"""vLLM-Omni deployment features that cannot run with this package's methods, refused at start-up.

A feature either runs with a quantized model and is tested (docs/deployment.md lists them), or it is
refused here, where vLLM-Omni has built the pipeline and before any weight is read
(:mod:`.build`'s ``initialize_model`` wrapper, in every worker). One table, :data:`REFUSALS`,
holds each refusal: which setting of the diffusion config selects the feature, the flag a user
passes, why the feature cannot hold what our Linears hold, and what to use instead. The message
names the flag, the methods the pipeline was built with and the alternative.

- **HSDP** (``--use-hsdp``): FSDP2 shards only floating-point parameters, so the packed FP4 weights
  and E8M0 scales stay replicated on every rank (no memory saved), and its mixed-precision policy
  casts the float parameters it does shard (DualScale's FP32 second-level scales, Smooth factors) to
  the compute dtype: different numbers, no error.
- **LoRA merged into the weights** (``--lora-backend distill``): vLLM-Omni adds ``B @ A`` to each
  Linear's weight after loading it; a packed FP4 weight is ``(N, K/2)`` bytes, and this package
  does not requantize a merged weight. The peft backend runs the LoRA as a BF16 branch next to the
  quantized Linear and is supported.
- **Cache backends other than cache-dit on Wan2.2** (``--cache-backend``): vLLM-Omni 0.30 has no
  TeaCache coefficients or extractor for ``WanTransformer3DModel``; MagCache has no Wan strategy, and
  its generic block hooks hand a block's tuple on where Wan's loop expects a tensor; SeaCache and
  StepCache support other families only. cache-dit has a Wan2.2 adapter and runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Refusal:
    """One deployment feature refused with our methods."""

    flag: str  # what a user passes, as vllm serve spells it (Omni(...) takes the keyword in brackets)
    selected: Callable[[Any, Any], str | None]  # (od_config, pipeline) -> the chosen value, or None
    reason: str
    instead: str


def _setting(value: Any) -> str:
    return str(getattr(value, "value", value))


def _hsdp(od_config: Any, pipeline: Any) -> str | None:
    parallel = getattr(od_config, "parallel_config", None)
    return "on" if getattr(parallel, "use_hsdp", False) else None


def _merged_lora(od_config: Any, pipeline: Any) -> str | None:
    backend = _setting(getattr(od_config, "lora_backend", "peft"))
    return backend if backend == "distill" else None


WAN_CACHE_BACKENDS = ("cache_dit",)
"""The cache backends that run vLLM-Omni's Wan2.2 pipelines (the others fail there, see the module)."""


def _wan_cache(od_config: Any, pipeline: Any) -> str | None:
    backend = _setting(getattr(od_config, "cache_backend", None) or "none").lower()
    wan = type(pipeline).__name__.startswith("Wan22")
    return backend if wan and backend not in ("none", *WAN_CACHE_BACKENDS) else None


REFUSALS = (
    Refusal(
        flag="--use-hsdp (use_hsdp)",
        selected=_hsdp,
        reason=(
            "FSDP2 shards only floating-point parameters, so the packed FP4 weights and E8M0 scales stay "
            "replicated on every rank (no memory is saved), and its mixed-precision cast turns the FP32 "
            "scales it does shard (DualScale's second level, Smooth factors) into the compute dtype"
        ),
        instead=(
            "split the work with --ulysses-degree / --ring-degree (sequence parallelism), "
            "--cfg-parallel-size or --tensor-parallel-size, which run with these methods"
        ),
    ),
    Refusal(
        flag="--lora-backend distill (lora_backend='distill')",
        selected=_merged_lora,
        reason=(
            "that backend adds the LoRA's B @ A to each Linear's weight after loading, and a packed FP4 "
            "weight (N, K/2 bytes) cannot take a BF16 (N, K) update; this package does not requantize "
            "merged weights"
        ),
        instead=(
            "use --lora-backend peft (the default: the LoRA runs as a BF16 branch next to each quantized "
            "Linear), or merge the LoRA into the BF16 checkpoint before quantizing it"
        ),
    ),
    Refusal(
        flag="--cache-backend (cache_backend)",
        selected=_wan_cache,
        reason=(
            "vLLM-Omni 0.30 runs only cache-dit on its Wan2.2 transformer: TeaCache has no coefficients or "
            "extractor for WanTransformer3DModel, MagCache has no Wan strategy (its generic block hooks "
            "return a tuple where Wan expects a tensor), SeaCache and StepCache support other families"
        ),
        instead="use --cache-backend cache_dit, which is tested with these methods on Wan2.2",
    ),
)


def quantized_methods(pipeline: torch.nn.Module) -> list[str]:
    """The names of this package's formats the pipeline's Linears run (``mxfp4``, ``mxfp4_dualscale``,
    ``mxfp8``), sorted; empty when the pipeline quantizes nothing with them."""
    names = set()
    for module in pipeline.modules():
        name = getattr(getattr(module, "quant_method", None), "method_name", "")
        if name:
            names.add(name)
    return sorted(names)


def check_deployment(pipeline: torch.nn.Module, od_config: Any) -> None:
    """Raise ``ValueError`` for the first feature of :data:`REFUSALS` that ``od_config`` selects while
    ``pipeline`` (as vLLM-Omni built it) holds Linears of our methods; nothing otherwise."""
    methods = quantized_methods(pipeline)
    if not methods:
        return
    for refusal in REFUSALS:
        value = refusal.selected(od_config, pipeline)
        if value is not None:
            raise ValueError(
                f"{refusal.flag} = {value} is not supported with {', '.join(methods)} "
                f"({type(pipeline).__name__}, vllm-omni-mxfp4): {refusal.reason}. Instead, {refusal.instead}."
            )
