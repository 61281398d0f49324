"""A runtime config against a checkpoint's own ``quantization_config``: what the engine will run.

vLLM-Omni's Wan2.2 pipeline reconciles each expert's runtime config with the
``quantization_config`` of that expert's ``transformer*/config.json`` in
``vllm_omni.quantization.factory.resolve_quant_config_from_disk`` (vLLM-Omni 0.30).
:func:`reconcile_with_checkpoint` gives the same result in pure Python, so that the example, the
demo and the docs report what the engine will do; ``tests/omni/test_reconcile_mirror.py`` runs
both on the same cases. This is the part of the package most likely to drift with upstream: a
change there is a change here (and in the mirror test's cases).

Which key wins a rebuild is each key's role (:mod:`.keys`): the checkpoint decides storage, the
runtime its policies, a requirement holds if either side sets it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from .keys import METHOD_KEYS, REQUIREMENT, method_name, method_of_mapping, show_value
from .methods import CONFIG_TYPES, Mxfp4Config, QuantConfig, config_class
from .parse import ComponentConfigs

logger = logging.getLogger(__name__)


def reconcile_with_checkpoint(
    runtime: QuantConfig | None, checkpoint_qc: Mapping | str | None
) -> QuantConfig | None:
    """Combine a runtime config with a checkpoint's ``quantization_config``, as vLLM-Omni does.

    - No checkpoint config: the runtime config (``None`` stays ``None``: an unquantized model).
    - No runtime config: auto-detection builds the checkpoint's config, saved policies included.
    - Different methods: ValueError telling the user to pass the matching flag or omit it.
    - A method-only checkpoint value (``"mxfp4"``, ``{"quant_method": "mxfp4"}``): the runtime config
      unchanged.
    - Otherwise the checkpoint dict is the base and the runtime contributes its runtime policies:
      the W4A8 lists (explicit empty lists included) and the scale algorithm;
      ``require_smooth_scale`` is true if either side sets it. A serialized checkpoint's
      ``ignored_layers`` (or alias; omitted means none) is its storage contract. The result is
      rebuilt from that base when the checkpoint is serialized and the runtime config is not, when
      the Smooth requirement changes, or when the ``ignored_layers`` differ (an online checkpoint
      config without an ``ignored_layers`` key does not state any); every other runtime key
      (``backend``, ``num_bf16_fallback_layers``) then takes the checkpoint's value or its default
      (``backend: auto`` then follows ``VLLM_OMNI_MXFP4_BACKEND``, read by the backends through
      ``vllm_omni_mxfp4.envs.backend()``). Without a rebuild the runtime config stands.
    - A runtime config that claims serialized weights against an online checkpoint config is an
      error here (the engine would fail loading the BF16 weights).
    """
    if runtime is not None and not isinstance(runtime, CONFIG_TYPES):
        raise TypeError(
            f"runtime must be an mxfp4 / mxfp4_dualscale config or None, got {show_value(runtime)}."
        )
    method, details = checkpoint_method(checkpoint_qc)
    if method is None:
        return runtime
    if runtime is None:
        cls = config_class(method)
        config = cls() if details is None else cls.from_dict(details)
        logger.info("Auto-detected %s quantization from the checkpoint's config.json: %s", method, config)
        return config
    if method != runtime.METHOD:
        raise ValueError(
            f"Checkpoint config.json declares quant_method={method!r} but the active quantization config "
            f"is {runtime.METHOD!r}. Pass a matching --quantization flag or omit it for auto-detection."
        )
    if details is None:
        return runtime
    checkpoint = type(runtime).from_dict(details)
    # A serialized checkpoint's config always states its BF16 layers (omitted: none); an online one
    # states them only with an explicit ignored_layers key.
    states_layers = checkpoint.is_serialized or "ignored_layers" in details
    return _rebuilt_if_needed(runtime, checkpoint, states_layers)


def _rebuilt_if_needed(runtime: QuantConfig, checkpoint: QuantConfig, states_layers: bool) -> QuantConfig:
    """The runtime config, or the one rebuilt from the checkpoint's when vLLM-Omni rebuilds it."""
    if runtime.is_serialized and not checkpoint.is_serialized:
        raise ValueError(
            f"The runtime {runtime.METHOD!r} config sets {runtime.serialized_key()}=true, but the checkpoint's "
            "quantization_config declares unquantized (online) weights. Drop the flag to quantize online, "
            "or load a pre-quantized checkpoint."
        )
    rebuilt = runtime.rebuilt_from_checkpoint(checkpoint)
    requirements = runtime.keys_with_role(REQUIREMENT)
    needs_rebuild = (
        (checkpoint.is_serialized and not runtime.is_serialized)
        or (states_layers and rebuilt.ignored_layers != runtime.ignored_layers)
        or any(getattr(rebuilt, name) != getattr(runtime, name) for name in requirements)
    )
    if not needs_rebuild:
        return runtime
    if runtime.ignored_layers and rebuilt.ignored_layers != runtime.ignored_layers:
        logger.warning(
            "The checkpoint's %s config sets ignored_layers %s, which replace the runtime's %s.",
            runtime.METHOD,
            list(rebuilt.ignored_layers),
            list(runtime.ignored_layers),
        )
    return rebuilt


def checkpoint_method(checkpoint_qc: Mapping | str | None) -> tuple[str | None, Mapping | None]:
    """(method, the dict if it carries more than the method) of a checkpoint's quantization_config."""
    if checkpoint_qc is None:
        return None, None
    if isinstance(checkpoint_qc, str):
        return method_name(checkpoint_qc, "The checkpoint's quantization_config"), None
    if not isinstance(checkpoint_qc, Mapping):
        raise TypeError(
            "A checkpoint's quantization_config must be a dict, a method name or None, "
            f"got {show_value(checkpoint_qc)}."
        )
    if not checkpoint_qc:
        return None, None
    method = method_of_mapping(checkpoint_qc, "the checkpoint's quantization_config")
    if method is None:
        raise ValueError(
            f"The checkpoint's quantization_config has no 'quant_method': {show_value(dict(checkpoint_qc))}."
        )
    method_only = set(checkpoint_qc) <= set(METHOD_KEYS)
    return method, None if method_only else checkpoint_qc


def checkpoint_ignored_layers(checkpoint_qc: Mapping | str | None) -> tuple[str, ...]:
    """The ``ignored_layers`` a checkpoint's ``quantization_config`` states itself (its storage
    contract; the ``modules_to_not_convert`` alias included): what the engine takes from the
    checkpoint whenever it states any (:func:`reconcile_with_checkpoint`). Empty when it states none,
    is not one of our methods or cannot be read: those are reported where the config is built."""
    try:
        method, details = checkpoint_method(checkpoint_qc)
        if method is None or details is None:
            return ()
        return config_class(method).from_dict(details).ignored_layers
    except (TypeError, ValueError):
        return ()


def resolve_component(
    spec: QuantConfig | ComponentConfigs | None, component: str, checkpoint_qc: Mapping | str | None
) -> QuantConfig | None:
    """The config of one component (Wan expert): per-component selection, then reconciliation.

    A component disabled by a per-component config (mapped to ``None``, or unmatched without a
    default) requires a checkpoint without quantization; otherwise ValueError.
    """
    if isinstance(spec, ComponentConfigs):
        selected = spec.for_component(component)
        if selected is None:
            if checkpoint_method(checkpoint_qc)[0] is not None:
                raise ValueError(
                    f"Quantization is disabled for component {component!r}, but its checkpoint declares "
                    "quantization. Use a BF16 checkpoint for this component or enable its matching "
                    "quantization method."
                )
            return None
        spec = selected
    return reconcile_with_checkpoint(spec, checkpoint_qc)


def nvfp4_source_config(runtime: QuantConfig, origin: str) -> Mxfp4Config:
    """The config a component whose checkpoint is NVFP4 (``origin`` says where that was declared) is
    served with when ``runtime`` asks for one of our methods: ``runtime`` with its weights marked
    serialized (they are requantized to MXFP4 while they load, docs/nvfp4.md).

    The producer's ``quantization_config`` does not take part: every key (ignored_layers, W4A8 lists,
    backend, ``nvfp4_requant_rule``) is the runtime's. ``mxfp4_dualscale`` is refused: requantization
    gives single-scale MXFP4 (one E8M0 scale per 32), the only format NVFP4 reaches without a second
    rounding; DualScale's FP32 per-512 scales would need one.
    """
    if not isinstance(runtime, Mxfp4Config):
        raise ValueError(
            f"{origin} declares an NVFP4 checkpoint, which {runtime.METHOD!r} cannot serve: NVFP4 is "
            "requantized to single-scale MXFP4 at load (one E8M0 scale per 32 elements, no per-512 FP32 "
            "scale), the only exact path. Pass quantization='mxfp4' (--quantization mxfp4) instead; "
            "ignored_layers carries over."
        )
    if runtime.svd_rank:
        raise ValueError(
            f"{origin} declares an NVFP4 checkpoint, and the mxfp4 config sets svd_rank {runtime.svd_rank}: "
            "NVFP4 weights are requantized to MXFP4 at load, so there is no BF16 weight to split into a "
            "low-rank branch and a residual. Remove svd_rank, or serve the BF16 model with svd_rank."
        )
    return dataclasses.replace(runtime, is_checkpoint_mxfp4_serialized=True)
