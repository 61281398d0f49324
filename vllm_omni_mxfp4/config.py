"""Quantization configs of the ``mxfp4`` and ``mxfp4_dualscale`` methods and their layer routing.

Users steer quantization through a config: a method name, a JSON object (string or file), a Python
dict, or the ``quantization_config`` block of a checkpoint's ``transformer/config.json``. This module
parses and validates all of them strictly, decides each Linear layer's precision
(BF16 > W4A8 by layer or step > W4A4), selects per-expert configs and reconciles a runtime config
with the checkpoint's own. The rules are the vLLM-Omni MXFP4 user guide's.

Pure Python and stdlib: the vLLM glue (``vllm_omni_mxfp4.omni``) builds on it.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

from vllm_omni_mxfp4.steps import current_denoise_step

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "npu", "rocm", "emulated")

_METHOD_KEYS = ("method", "quant_method")
_KEY_ALIASES = {"modules_to_not_convert": "ignored_layers"}
_SCALE_RULES = {0: "floor", 2: "uos"}

# --------------------------------------------------------------------------------------------------
# Validation helpers: one per kind of value. Each takes the key (for the message) and the raw value,
# and returns the normalized value or raises ValueError.
# --------------------------------------------------------------------------------------------------

_LAYER_PATH = re.compile(r"[A-Za-z_][A-Za-z_0-9]*(\.[A-Za-z_0-9]+)*")
_WILDCARD_CHARS = frozenset("*?[]{}^$+|()\\")
_EXPERT_PREFIX = re.compile(r"transformer(_\d+)?\.")
_SPLIT_SELF_ATTENTION = re.compile(r"(?:^|\.)attn1\.to_[qkv]$")
_TENSOR_NAMES = ("weight", "bias", "weight_scale", "weight_dual_scale", "mul_scale")
_BLOCK_INDEX = re.compile(r"^blocks\.(\d+)\.")


def _show(value: object, limit: int = 120) -> str:
    """``repr`` of a user value, shortened for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be a boolean (true or false), got {_show(value)}.")
    return value


def _check_count(key: str, value: object) -> int:
    if not _is_int(value) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {_show(value)}.")
    return value


def _check_scale_alg(key: str, value: object) -> int:
    if not _is_int(value) or value not in _SCALE_RULES:
        raise ValueError(f"{key} must be 0 (OCP MX) or 2 (UOS with dst_type_max=7.25). Got {_show(value)}.")
    return value


def _check_backend(key: str, value: object) -> str:
    if not isinstance(value, str) or value not in BACKENDS:
        valid = ", ".join(repr(b) for b in BACKENDS)
        raise ValueError(f"{key} must be one of {valid}, got {_show(value)}.")
    return value


def _check_steps(key: str, value: object) -> tuple[int, ...]:
    """A list of denoise-loop indices; ``None`` means none. Deduplicated and sorted."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(_is_int(s) and s >= 0 for s in value):
        raise ValueError(
            f"{key} must be a list of non-negative integer denoise step indices. Got {_show(value)}."
        )
    return tuple(sorted(set(value)))


def _layer_path_problem(name: object) -> str | None:
    """Why ``name`` is not an exact runtime Linear path relative to an expert, or ``None``."""
    if not isinstance(name, str):
        return f"Entry {_show(name)} is not a string."
    if not name.strip():
        return f"Entry {name!r} is empty."
    if _WILDCARD_CHARS.intersection(name):
        return (
            f"Entry {name!r} looks like a wildcard or regular expression; list every layer by its exact "
            "path, e.g. 'blocks.3.attn1.to_qkv'."
        )
    if _EXPERT_PREFIX.match(name):
        relative = name.split(".", 1)[1]
        return (
            f"Entry {name!r} starts with an expert name; paths are relative to each expert "
            f"(use {relative!r}). Give experts different lists with a per-component config."
        )
    module, _, last = name.rpartition(".")
    if module and last in _TENSOR_NAMES:
        return f"Entry {name!r} names a tensor; use the module path {module!r} without '.{last}'."
    if not _LAYER_PATH.fullmatch(name):
        return f"Entry {name!r} is not a dotted module path like 'blocks.3.ffn.net_2'."
    if _SPLIT_SELF_ATTENTION.search(name):
        fused = name.rpartition(".")[0] + ".to_qkv"
        return (
            f"Entry {name!r} is a checkpoint name: self-attention Q/K/V run as one fused Linear. "
            f"Use attn1.to_qkv ({fused!r}) for fused self-attention, not checkpoint attn1.to_q/to_k/to_v names."
        )
    return None


def _check_layers(key: str, value: object) -> tuple[str, ...]:
    """A list of exact runtime Linear paths; ``None`` means none. Deduplicated and sorted."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"{key} must be a list of non-empty exact runtime Linear paths. Got {_show(value)}, not a list."
        )
    for name in value:
        problem = _layer_path_problem(name)
        if problem is not None:
            raise ValueError(f"{key} must be a list of non-empty exact runtime Linear paths. {problem}")
    return tuple(sorted(set(value)))


def _key(default: Any, check: Callable[[str, Any], Any]) -> Any:
    """A config key: a dataclass field with its default and its validation helper."""
    return field(default=default, metadata={"check": check})


def _unknown_key_error(
    key: object, valid: Iterable[str], what: str, valid_label: str = "Valid keys"
) -> ValueError:
    """``Unknown <what> 'key'. Did you mean ...? <valid_label>: ...`` with a difflib suggestion."""
    valid = sorted(valid)
    hint = ""
    if isinstance(key, str):
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"Unknown {what} {_show(key)}.{hint} {valid_label}: {', '.join(valid)}.")


def _method_name(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string naming a quantization method, got {_show(value)}.")
    return value.strip().lower()


def _method_of_mapping(spec: Mapping, where: str) -> str | None:
    """The method named by ``method`` / ``quant_method`` (aliases that must agree), or ``None``."""
    named = {key: _method_name(spec[key], f"{where} {key!r}") for key in _METHOD_KEYS if key in spec}
    if len(set(named.values())) > 1:
        raise ValueError(
            f"Conflicting quantization method keys in {where}: method={spec['method']!r} vs "
            f"quant_method={spec['quant_method']!r}. They are aliases and must agree."
        )
    return next(iter(named.values()), None)


# --------------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------------


class Precision(str, Enum):
    """How a Linear layer runs: unquantized, MXFP4 weights with MXFP8 or MXFP4 activations."""

    BF16 = "bf16"
    W4A8 = "w4a8"
    W4A4 = "w4a4"


@dataclass(frozen=True)
class LayerRoute:
    """The precision decision for one Linear layer.

    ``precision`` is the static decision. A W4A4 layer with non-empty ``a8_steps`` runs W4A8 on those
    denoise steps, so it needs the current step at forward time.
    """

    precision: Precision
    a8_steps: tuple[int, ...] = ()
    reason: str = ""
    prefix: str = ""

    def precision_at(self, step: int | None) -> Precision:
        """The precision at denoise step ``step``: BF16 > W4A8 (layer) > W4A8 (step) > W4A4."""
        if self.precision is not Precision.W4A4 or not self.a8_steps:
            return self.precision
        if step is None:
            raise RuntimeError(
                f"Layer {self.prefix!r} has W4A8 fallback on denoise steps {list(self.a8_steps)} but no "
                "denoise step is published. Run it inside a vLLM-Omni pipeline that records "
                "ForwardContext.denoise_step_idx, or wrap the call in "
                "vllm_omni_mxfp4.steps.denoise_step(step)."
            )
        if not _is_int(step):
            raise TypeError(f"The denoise step must be an integer or None, got {_show(step)}.")
        return Precision.W4A8 if step in self.a8_steps else Precision.W4A4

    def precision_now(self) -> Precision:
        """The precision at the current denoise step; looks the step up only when it matters."""
        if self.precision is not Precision.W4A4 or not self.a8_steps:
            return self.precision
        return self.precision_at(current_denoise_step())


# --------------------------------------------------------------------------------------------------
# The two configs
# --------------------------------------------------------------------------------------------------


_C = TypeVar("_C", bound="_ConfigBase")


class _ConfigBase:
    """What both configs share: validation, parsing, serialization and routing.

    A subclass is a frozen dataclass whose fields are its keys (declared with :func:`_key`) and sets:
    ``METHOD``; ``_SERIALIZED_KEY`` (its offline flag); ``_STORAGE_KEYS`` (what a serialized
    checkpoint config decides); ``_STICKY_TRUE_KEYS`` (booleans that stay true if either the runtime
    or the checkpoint sets them); ``_RUNTIME_POLICY_KEYS`` (what a runtime config keeps when the config
    is rebuilt from a checkpoint's); ``_EMPTY_ONLY_KEYS`` (accepted keys that must stay empty, with the
    reason in ``_EMPTY_ONLY_MESSAGE``).
    """

    METHOD: ClassVar[str]
    _SERIALIZED_KEY: ClassVar[str]
    _STORAGE_KEYS: ClassVar[tuple[str, ...]]
    _STICKY_TRUE_KEYS: ClassVar[tuple[str, ...]] = ()
    _RUNTIME_POLICY_KEYS: ClassVar[tuple[str, ...]] = ()
    _EMPTY_ONLY_KEYS: ClassVar[Mapping[str, Callable[[str, Any], Any]]] = MappingProxyType({})
    _EMPTY_ONLY_MESSAGE: ClassVar[str] = ""

    ignored_layers: tuple[str, ...]

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))
        self._check_combination()

    def _check_combination(self) -> None:
        """Rules that involve several keys; none by default."""

    @classmethod
    def valid_keys(cls) -> tuple[str, ...]:
        """Every key a dict for this method may hold (fields, aliases, method keys)."""
        names = [f.name for f in fields(cls)]
        aliases = [alias for alias, target in _KEY_ALIASES.items() if target in names]
        return (*_METHOD_KEYS, *names, *aliases, *cls._EMPTY_ONLY_KEYS)

    @property
    def is_serialized(self) -> bool:
        """Whether the weights are pre-quantized in the checkpoint (offline mode)."""
        return getattr(self, self._SERIALIZED_KEY)

    @classmethod
    def from_dict(cls: type[_C], d: Mapping[str, Any]) -> _C:
        """Build from a dict (inline spec or checkpoint ``quantization_config``); strict on keys."""
        if not isinstance(d, Mapping):
            raise TypeError(f"A {cls.METHOD!r} quantization config must be a dict, got {_show(d)}.")
        method = _method_of_mapping(d, f"the {cls.METHOD!r} quantization config")
        if method is not None and method != cls.METHOD:
            raise ValueError(
                f"Quantization config declares method {method!r}, expected {cls.METHOD!r} for {cls.__name__}."
            )
        names = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key in _METHOD_KEYS:
                continue
            name = _KEY_ALIASES.get(key, key) if isinstance(key, str) else key
            if name in names:
                value = names[name].metadata["check"](key, value)
                kwargs[name] = _merge_alias(name, kwargs[name], value) if name in kwargs else value
            elif key in cls._EMPTY_ONLY_KEYS:
                if cls._EMPTY_ONLY_KEYS[key](key, value):
                    raise ValueError(cls._EMPTY_ONLY_MESSAGE)
            else:
                raise _unknown_key_error(
                    key, cls.valid_keys(), f"key in the {cls.METHOD!r} quantization config:"
                )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict with ``quant_method`` that :meth:`from_dict` turns back into this config."""
        out: dict[str, Any] = {"quant_method": self.METHOD}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_checkpoint_dict(self) -> dict[str, Any]:
        """The ``quantization_config`` a checkpoint's ``config.json`` carries: the storage contract only.

        Runtime policies (W4A8 lists, scale algorithm, backend, leading-block rule) stay out, so that
        the block is exactly the user guide's and auto-detection leaves those to the runtime defaults.
        """
        keys = (*self._STORAGE_KEYS, *self._STICKY_TRUE_KEYS)
        return {key: value for key, value in self.to_dict().items() if key == "quant_method" or key in keys}

    # Routing ---------------------------------------------------------------------------------------

    def _bf16_reason(self, prefix: str) -> str | None:
        if prefix in self.ignored_layers:
            return "listed in ignored_layers"
        return None

    @property
    def _w4a8_layers(self) -> tuple[str, ...]:
        return ()

    @property
    def _w4a8_steps(self) -> tuple[int, ...]:
        return ()

    def route(self, prefix: str) -> LayerRoute:
        """The precision of the Linear at runtime path ``prefix`` (relative to its expert)."""
        if not isinstance(prefix, str):
            raise TypeError(f"A layer prefix must be a string, got {_show(prefix)}.")
        reason = self._bf16_reason(prefix)
        if reason is not None:
            return LayerRoute(Precision.BF16, (), reason, prefix)
        if prefix in self._w4a8_layers:
            return LayerRoute(Precision.W4A8, (), "listed in w4a8_fallback_layers", prefix)
        steps = self._w4a8_steps
        reason = f"W4A4; W4A8 on denoise steps {list(steps)}" if steps else "W4A4"
        return LayerRoute(Precision.W4A4, steps, reason, prefix)

    # Reconciliation --------------------------------------------------------------------------------

    def _rebuilt_from(self: _C, checkpoint: _C) -> _C:
        """The checkpoint's config with this runtime config's runtime policies (W4A8 lists, scale
        algorithm) and the union of both Smooth requirements: vLLM-Omni's rebuild."""
        changes = {name: getattr(self, name) for name in self._RUNTIME_POLICY_KEYS}
        changes.update(
            {name: getattr(self, name) or getattr(checkpoint, name) for name in self._STICKY_TRUE_KEYS}
        )
        return replace(checkpoint, **changes)


def _merge_alias(name: str, first: tuple, second: tuple) -> tuple:
    """Two spellings of one list key (e.g. ``modules_to_not_convert``): one may be empty, else equal."""
    if first and second and first != second:
        aliases = " / ".join([name, *(a for a, t in _KEY_ALIASES.items() if t == name)])
        raise ValueError(
            f"{aliases} are aliases and must agree when both are non-empty: {list(first)} vs {list(second)}."
        )
    return first or second


@dataclass(frozen=True)
class Mxfp4Config(_ConfigBase):
    """``mxfp4``: single-scale OCP MXFP4 (E2M1 + one E8M0 scale per 32), online or offline."""

    is_checkpoint_mxfp4_serialized: bool = _key(False, _check_bool)
    ignored_layers: tuple[str, ...] = _key((), _check_layers)
    w4a8_fallback_layers: tuple[str, ...] = _key((), _check_layers)
    w4a8_fallback_steps: tuple[int, ...] = _key((), _check_steps)
    require_smooth_scale: bool = _key(False, _check_bool)
    mxfp4_scale_alg: int = _key(0, _check_scale_alg)
    backend: str = _key("auto", _check_backend)

    METHOD: ClassVar[str] = "mxfp4"
    _SERIALIZED_KEY: ClassVar[str] = "is_checkpoint_mxfp4_serialized"
    _STORAGE_KEYS: ClassVar[tuple[str, ...]] = ("is_checkpoint_mxfp4_serialized", "ignored_layers")
    _STICKY_TRUE_KEYS: ClassVar[tuple[str, ...]] = ("require_smooth_scale",)
    _RUNTIME_POLICY_KEYS: ClassVar[tuple[str, ...]] = (
        "w4a8_fallback_layers",
        "w4a8_fallback_steps",
        "mxfp4_scale_alg",
    )

    def _check_combination(self) -> None:
        if self.require_smooth_scale and not self.is_checkpoint_mxfp4_serialized:
            raise ValueError(
                "require_smooth_scale requires an offline MXFP4 checkpoint "
                "(is_checkpoint_mxfp4_serialized=true); online quantization has no calibrated mul_scale."
            )

    @property
    def scale_rule(self) -> str:
        """The MX scale rule of ``vllm_omni_mxfp4.formats``: ``"floor"`` (OCP) or ``"uos"``."""
        return _SCALE_RULES[self.mxfp4_scale_alg]

    @property
    def _w4a8_layers(self) -> tuple[str, ...]:
        return self.w4a8_fallback_layers

    @property
    def _w4a8_steps(self) -> tuple[int, ...]:
        return self.w4a8_fallback_steps


@dataclass(frozen=True)
class Mxfp4DualScaleConfig(_ConfigBase):
    """``mxfp4_dualscale``: per-32 E8M0 + per-512 FP32 scales + ``mul_scale``, online or offline."""

    is_checkpoint_serialized: bool = _key(False, _check_bool)
    ignored_layers: tuple[str, ...] = _key((), _check_layers)
    num_bf16_fallback_layers: int = _key(5, _check_count)
    backend: str = _key("auto", _check_backend)

    METHOD: ClassVar[str] = "mxfp4_dualscale"
    _SERIALIZED_KEY: ClassVar[str] = "is_checkpoint_serialized"
    _STORAGE_KEYS: ClassVar[tuple[str, ...]] = ("is_checkpoint_serialized", "ignored_layers")
    _EMPTY_ONLY_KEYS: ClassVar[Mapping[str, Callable[[str, Any], Any]]] = MappingProxyType(
        {"w4a8_fallback_layers": _check_layers, "w4a8_fallback_steps": _check_steps}
    )
    _EMPTY_ONLY_MESSAGE: ClassVar[str] = (
        "mxfp4_dualscale does not support W4A8 fallback. Use mxfp4 with single-scale weights; "
        "changing a DualScale checkpoint's method name does not convert its storage format."
    )

    def _bf16_reason(self, prefix: str) -> str | None:
        """``ignored_layers`` first, then (online only) the leading-block rule."""
        reason = super()._bf16_reason(prefix)
        if reason is not None or self.is_checkpoint_serialized:
            return reason
        match = _BLOCK_INDEX.match(prefix)
        if match and int(match.group(1)) < self.num_bf16_fallback_layers:
            return f"in the first {self.num_bf16_fallback_layers} blocks (num_bf16_fallback_layers, online)"
        return None


QuantConfig = Mxfp4Config | Mxfp4DualScaleConfig
_CONFIG_TYPES = (Mxfp4Config, Mxfp4DualScaleConfig)
CONFIG_CLASSES: Mapping[str, type[QuantConfig]] = MappingProxyType({cls.METHOD: cls for cls in _CONFIG_TYPES})
SUPPORTED_METHODS = tuple(CONFIG_CLASSES)


def _config_class(method: str) -> type[QuantConfig]:
    if method not in CONFIG_CLASSES:
        close = difflib.get_close_matches(method, SUPPORTED_METHODS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"Unknown quantization method {method!r} for vllm-omni-mxfp4.{hint} "
            f"Supported: {', '.join(SUPPORTED_METHODS)}."
        )
    return CONFIG_CLASSES[method]


# --------------------------------------------------------------------------------------------------
# Per-component configs and parsing
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComponentConfigs:
    """Per-component configs, e.g. one per Wan expert, selected by exact component name.

    ``None`` (for a component, or as the default) disables quantization there; that component then
    needs a BF16 checkpoint.
    """

    components: Mapping[str, QuantConfig | None]
    default: QuantConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.components, Mapping):
            raise TypeError(f"components must be a mapping, got {_show(self.components)}.")
        for name, config in [*self.components.items(), ("default", self.default)]:
            if not isinstance(name, str) or not name:
                raise ValueError(f"A component name must be a non-empty string, got {_show(name)}.")
            if config is not None and not isinstance(config, _CONFIG_TYPES):
                raise TypeError(f"The config of component {name!r} must be a quantization config or None.")
        if "default" in self.components:
            raise ValueError(
                "Pass the 'default' config as ComponentConfigs(default=...), not as a component."
            )
        object.__setattr__(self, "components", MappingProxyType(dict(self.components)))

    def for_component(self, name: str) -> QuantConfig | None:
        """The config of component ``name`` (exact match), else the default."""
        return self.components.get(name, self.default)

    def check_names(self, known: Iterable[str]) -> None:
        """Raise ValueError if a configured component is not among ``known`` (catches typos)."""
        known = sorted(known)
        for name in self.components:
            if name not in known:
                raise _unknown_key_error(name, known, "component", "Known components")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able per-component dict that :func:`parse_quantization` turns back into this."""
        out = {name: None if c is None else c.to_dict() for name, c in self.components.items()}
        out["default"] = None if self.default is None else self.default.to_dict()
        return out


def _read_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from None


def _parse_method_name(text: str) -> QuantConfig | None:
    """``"none"`` or a method name (any case) as a default config."""
    method = text.strip().lower()
    return None if method == "none" else _config_class(method)()


def _parse_string(spec: str) -> QuantConfig | ComponentConfigs | None:
    """A method name, a JSON text or a JSON file path. A string inside JSON is a method name only."""
    text = spec.strip()
    if text[:1] in ("{", "[", '"') or text == "null":
        decoded = _read_json(text, "The quantization config string")
    elif text.lower() in ("none", *SUPPORTED_METHODS):
        return _parse_method_name(text)
    elif os.path.isfile(text):
        try:
            with open(text, encoding="utf-8") as fh:
                content = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"Cannot read quantization config file {text!r}: {exc}") from None
        decoded = _read_json(content, f"Quantization config file {text!r}")
    elif text.endswith(".json") or os.sep in text:
        raise ValueError(f"Quantization config file {text!r} does not exist or is not a file.")
    else:
        return _parse_method_name(text)
    return _parse_method_name(decoded) if isinstance(decoded, str) else parse_quantization(decoded)


def _parse_mapping(spec: Mapping) -> QuantConfig | ComponentConfigs:
    for key in spec:
        if not isinstance(key, str):
            raise TypeError(f"Quantization config keys must be strings, got {_show(key)}.")
    method = _method_of_mapping(spec, "the quantization config")
    if method is not None:
        return _config_class(method).from_dict(spec)
    if not spec:
        raise ValueError(
            f"Empty quantization config: name a method with 'method' ({', '.join(SUPPORTED_METHODS)})."
        )
    config_keys = sorted(set(spec).intersection(k for c in CONFIG_CLASSES.values() for k in c.valid_keys()))
    if config_keys:
        raise ValueError(
            f"The quantization config has keys {config_keys} but no 'method' (or 'quant_method'); "
            f"add one of {', '.join(repr(m) for m in SUPPORTED_METHODS)}."
        )
    components: dict[str, QuantConfig | None] = {}
    for name, value in spec.items():
        if value is not None and not isinstance(value, (str, Mapping, *_CONFIG_TYPES)):
            raise ValueError(
                f"Per-component quantization config: the value of {name!r} must be a method name, a dict "
                f"or null, got {_show(value)}. A flat config needs a 'method' key."
            )
        config = _parse_method_name(value) if isinstance(value, str) else parse_quantization(value)
        if isinstance(config, ComponentConfigs):
            raise ValueError(
                f"Per-component quantization config: {name!r} cannot hold per-component configs."
            )
        components[name] = config
    default = components.pop("default", None)
    return ComponentConfigs(components, default)


def parse_quantization(spec: Any) -> QuantConfig | ComponentConfigs | None:
    """Parse any user spelling of a quantization config.

    ``spec`` is ``None`` or ``"none"`` (no config), a method name (``"mxfp4"``, ``"mxfp4_dualscale"``),
    a JSON string or a path to a JSON file, a dict (flat, with ``method`` / ``quant_method``, or
    per-component: ``{"transformer": ..., "transformer_2": ..., "default": ...}``), or an existing
    config. Errors are ValueError (bad content) or TypeError (a value of the wrong Python type).
    """
    if spec is None or isinstance(spec, (ComponentConfigs, *_CONFIG_TYPES)):
        return spec
    if isinstance(spec, str):
        return _parse_string(spec)
    if isinstance(spec, Mapping):
        return _parse_mapping(spec)
    raise TypeError(
        f"A quantization config must be None, a method name, a JSON string or file, or a dict; got {_show(spec)}."
    )


# --------------------------------------------------------------------------------------------------
# Checkpoint reconciliation
# --------------------------------------------------------------------------------------------------


def _checkpoint_method(checkpoint_qc: Mapping | str | None) -> tuple[str | None, Mapping | None]:
    """(method, the dict if it carries more than the method) of a checkpoint quantization_config."""
    if checkpoint_qc is None:
        return None, None
    if isinstance(checkpoint_qc, str):
        return _method_name(checkpoint_qc, "The checkpoint's quantization_config"), None
    if not isinstance(checkpoint_qc, Mapping):
        raise TypeError(
            f"A checkpoint's quantization_config must be a dict, a method name or None, got {_show(checkpoint_qc)}."
        )
    if not checkpoint_qc:
        return None, None
    method = _method_of_mapping(checkpoint_qc, "the checkpoint's quantization_config")
    if method is None:
        raise ValueError(
            f"The checkpoint's quantization_config has no 'quant_method': {_show(dict(checkpoint_qc))}."
        )
    method_only = set(checkpoint_qc) <= set(_METHOD_KEYS)
    return method, None if method_only else checkpoint_qc


def reconcile_with_checkpoint(
    runtime: QuantConfig | None, checkpoint_qc: Mapping | str | None
) -> QuantConfig | None:
    """Combine a runtime config with a checkpoint's ``quantization_config``, as vLLM-Omni does.

    This mirrors ``vllm_omni.quantization.factory.resolve_quant_config_from_disk`` (0.30), which is
    what the engine runs for each Wan expert, so that the example and the docs report what the
    engine will do:

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
      the Smooth requirement changes, or when the ``ignored_layers`` differ; every other runtime key
      (``backend``, ``num_bf16_fallback_layers``) then takes the checkpoint's value or its default
      (``VLLM_OMNI_MXFP4_BACKEND`` picks the backend in that case). Without a rebuild the runtime
      config stands.
    - A runtime config that claims serialized weights against an online checkpoint config is an
      error here (the engine would fail loading the BF16 weights).
    """
    if runtime is not None and not isinstance(runtime, _CONFIG_TYPES):
        raise TypeError(f"runtime must be an mxfp4 / mxfp4_dualscale config or None, got {_show(runtime)}.")
    method, details = _checkpoint_method(checkpoint_qc)
    if method is None:
        return runtime
    if runtime is None:
        cls = _config_class(method)
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
    if runtime.is_serialized and not checkpoint.is_serialized:
        raise ValueError(
            f"The runtime {runtime.METHOD!r} config sets {runtime._SERIALIZED_KEY}=true, but the checkpoint's "
            "quantization_config declares unquantized (online) weights. Drop the flag to quantize online, "
            "or load a pre-quantized checkpoint."
        )
    rebuilt = runtime._rebuilt_from(checkpoint)
    needs_rebuild = (
        (checkpoint.is_serialized and not runtime.is_serialized)
        or rebuilt.ignored_layers != runtime.ignored_layers
        or getattr(rebuilt, "require_smooth_scale", False) != getattr(runtime, "require_smooth_scale", False)
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
            if _checkpoint_method(checkpoint_qc)[0] is not None:
                raise ValueError(
                    f"Quantization is disabled for component {component!r}, but its checkpoint declares "
                    "quantization. Use a BF16 checkpoint for this component or enable its matching "
                    "quantization method."
                )
            return None
        spec = selected
    return reconcile_with_checkpoint(spec, checkpoint_qc)
