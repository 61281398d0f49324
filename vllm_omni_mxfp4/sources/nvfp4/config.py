"""Producer quantization configs, parsed into one :class:`ProducerConfig`.

Forms read (docs/nvfp4.md, "Detection"):

- ModelOpt flat (``config.json`` ``quantization_config``, also copied into safetensors headers):
  ``quant_method`` ``modelopt`` / ``modelopt_fp4`` / ``nvfp4``, ``quant_algo``, ``config_groups``
  with ``weights.group_size``, ``ignore``; SGLang's re-packed repos add ``swap_weight_nibbles`` and
  ``checkpoint_weight_scale_layout``;
- ModelOpt nested (``hf_quant_config.json``): ``{"producer": ..., "quantization": {"quant_algo",
  "group_size", "exclude_modules", "quantized_layers"}}``;
- ``MIXED_PRECISION`` (either form): per-layer algorithms in ``quantized_layers``;
- compressed-tensors: ``quant_method`` ``compressed-tensors`` with the ``nvfp4-pack-quantized``
  format (global scale stored as a divisor), ``ignore``.

Exclude keys ``ignore``, ``exclude_modules`` and ``exclude`` are all read (their union): a pattern
is a regular expression when prefixed ``re:`` (matched from the start, as compressed-tensors and
vLLM do) and a glob otherwise. Algorithms we cannot reproduce are refused here, naming the file.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_omni_mxfp4 import spec

from .records import NIBBLE_ORDERS, SCALE_LAYOUTS, SourceError

REQUANT_ALGOS = frozenset({"NVFP4", "W4A16_NVFP4", "NVFP4_AWQ", "W4A8_NVFP4_FP8"})
"""Algorithms whose weights are plain NVFP4 (activation settings do not matter: MXFP4 activations
are quantized dynamically)."""

DEQUANT_ALGOS = frozenset({"FP8"})
"""Per-layer algorithms of mixed checkpoints served in BF16 (FP8 precision or better)."""

REFUSED_ALGOS = {
    "NVFP4_SVD": "SVDQuant keeps a BF16 low-rank branch and a smoothing next to the NVFP4 weight",
    "NVFP4_SVDQUANT": "SVDQuant keeps a BF16 low-rank branch and a smoothing next to the NVFP4 weight",
}
"""NVFP4-family algorithms we refuse, with the reason."""

MODELOPT_METHODS = ("modelopt", "modelopt_fp4", "nvfp4")
CT_METHOD = "compressed-tensors"
CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
EXCLUDE_KEYS = ("ignore", "exclude_modules", "exclude")


@dataclass(frozen=True)
class ProducerConfig:
    """What a producer's config declares about its NVFP4 checkpoint.

    ``algo`` is the top-level algorithm (``NVFP4``, ``W4A16_NVFP4``, ``MIXED_PRECISION``...);
    ``layer_algos`` the per-layer ones of ``MIXED_PRECISION``; ``excludes`` ``(key, pattern)``
    pairs; ``nibble_order`` / ``scale_layout`` the producer's declared or default conventions
    (``None``: not declared, decided from shapes).
    """

    producer: str
    origin: str
    algo: str
    layer_algos: Mapping[str, str] = field(default_factory=dict)
    excludes: tuple[tuple[str, str], ...] = ()
    nibble_order: str = "low_even"
    scale_layout: str | None = None

    def excluded_by(self, name: str) -> str | None:
        """``"ignore pattern 'x'"`` for the first exclude pattern matching module ``name``, else None."""
        for key, pattern in self.excludes:
            if _matches(pattern, name):
                return f"{key} pattern {pattern!r}"
        return None

    def algo_of(self, name: str) -> str | None:
        """The algorithm declared for module ``name`` (None: a mixed checkpoint that does not list it)."""
        if self.algo != "MIXED_PRECISION":
            return self.algo
        return self.layer_algos.get(name)


def _matches(pattern: str, name: str) -> bool:
    """``re:`` regex (matched from the start) or glob, against a module name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def _excludes(cfg: Mapping[str, Any], origin: str) -> tuple[tuple[str, str], ...]:
    """``(key, pattern)`` pairs of every exclude key present; a non-list value is refused."""
    pairs = []
    for key in EXCLUDE_KEYS:
        value = cfg.get(key) or []
        if isinstance(value, str) or not all(isinstance(p, str) for p in value):
            raise SourceError(origin, f"{key!r} must be a list of module patterns, got {value!r}")
        pairs.extend((key, p) for p in value)
    return tuple(pairs)


def _check_algo(algo: str, where: str) -> None:
    """Refuse an algorithm we cannot requantize or serve, naming where it was declared."""
    if algo in REFUSED_ALGOS:
        raise SourceError(
            where, f"quant_algo {algo}: {REFUSED_ALGOS[algo]}", "use a plain NVFP4 export or the BF16 model"
        )
    if algo not in REQUANT_ALGOS | DEQUANT_ALGOS:
        known = sorted(REQUANT_ALGOS | DEQUANT_ALGOS)
        raise SourceError(where, f"unknown quant_algo {algo!r} (known: {known})", "use an NVFP4 export")


def _check_group_size(size: Any, where: str) -> None:
    """NVFP4 groups are 16 elements; any other declared size contradicts the tensors we would read."""
    if size is not None and size != spec.NVFP4_BLOCK:
        raise SourceError(
            where,
            f"group_size {size} contradicts NVFP4's {spec.NVFP4_BLOCK}",
            "this is not an NVFP4 checkpoint",
        )


def _layer_algos(details: Mapping[str, Any], origin: str) -> dict[str, str]:
    """``quantized_layers`` of a MIXED_PRECISION config: module -> algorithm, each one checked."""
    layers = details.get("quantized_layers")
    if not isinstance(layers, Mapping) or not layers:
        raise SourceError(
            origin, "MIXED_PRECISION without a 'quantized_layers' table", "re-export the checkpoint"
        )
    out = {}
    for name, layer in layers.items():
        algo = str(layer.get("quant_algo", "")).upper()
        _check_algo(algo, f"{name} ({origin})")
        _check_group_size(layer.get("group_size") if algo in REQUANT_ALGOS else None, f"{name} ({origin})")
        out[name] = algo
    return out


def _sglang_keys(cfg: Mapping[str, Any], origin: str) -> tuple[str, str | None]:
    """SGLang's declared nibble order and scale layout (``swap_weight_nibbles``,
    ``checkpoint_weight_scale_layout``); ModelOpt's low-nibble-even and ``None`` when absent."""
    swap = cfg.get("swap_weight_nibbles", False)
    if not isinstance(swap, bool):
        raise SourceError(origin, f"swap_weight_nibbles must be true or false, got {swap!r}")
    layout = cfg.get("checkpoint_weight_scale_layout")
    if layout is not None and layout not in SCALE_LAYOUTS:
        raise SourceError(
            origin, f"unknown checkpoint_weight_scale_layout {layout!r} (known: {list(SCALE_LAYOUTS)})"
        )
    return NIBBLE_ORDERS[1] if swap else NIBBLE_ORDERS[0], layout


def _modelopt(cfg: Mapping[str, Any], details: Mapping[str, Any], origin: str) -> ProducerConfig | None:
    """A ModelOpt config: ``cfg`` the whole dict, ``details`` the part with ``quant_algo`` (itself
    for the flat form, ``quantization`` for the nested one). None for a checkpoint with no NVFP4."""
    algo = str(details.get("quant_algo") or "").upper()
    if algo in DEQUANT_ALGOS or not algo:
        return None  # FP8 / unquantized ModelOpt checkpoints are not NVFP4 sources
    if algo == "MIXED_PRECISION":
        layer_algos = _layer_algos(details, origin)
        if not REQUANT_ALGOS & set(layer_algos.values()):
            return None
    else:
        _check_algo(algo, origin)
        layer_algos = {}
    _check_group_size(details.get("group_size"), origin)
    for group in (cfg.get("config_groups") or {}).values():
        _check_group_size((group.get("weights") or {}).get("group_size"), origin)
    nibbles, layout = _sglang_keys(cfg, origin)
    excludes = _excludes(details, origin) + (_excludes(cfg, origin) if details is not cfg else ())
    return ProducerConfig("modelopt", origin, algo, layer_algos, excludes, nibbles, layout)


def _compressed_tensors(cfg: Mapping[str, Any], origin: str) -> ProducerConfig | None:
    """A compressed-tensors config with the NVFP4 packed format (any group), else None."""
    groups = cfg.get("config_groups") or {}
    formats = {cfg.get("format")} | {g.get("format") for g in groups.values()}
    if CT_NVFP4_FORMAT not in formats:
        return None
    for group in groups.values():
        if group.get("format", cfg.get("format")) == CT_NVFP4_FORMAT:
            _check_group_size((group.get("weights") or {}).get("group_size"), origin)
    return ProducerConfig(CT_METHOD, origin, "NVFP4", excludes=_excludes(cfg, origin), scale_layout="linear")


def parse_quant_config(cfg: Mapping[str, Any], origin: str) -> ProducerConfig | None:
    """The :class:`ProducerConfig` of a quantization config dict, or None when it declares no NVFP4.

    ``origin`` names the file and key for messages (``"transformer/config.json quantization_config"``).
    Raises :class:`~.records.SourceError` for NVFP4-family configs we cannot reproduce.
    """
    if not isinstance(cfg, Mapping):
        raise SourceError(origin, f"expected a JSON object, got {type(cfg).__name__}")
    nested = cfg.get("quantization")
    if isinstance(nested, Mapping):
        return _modelopt(cfg, nested, origin)
    method = str(cfg.get("quant_method") or "").lower()
    if method in MODELOPT_METHODS:
        return _modelopt(cfg, cfg, origin)
    if method == CT_METHOD:
        return _compressed_tensors(cfg, origin)
    return None
