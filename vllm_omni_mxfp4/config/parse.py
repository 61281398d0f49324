"""Every user spelling of a quantization config, parsed strictly: :func:`parse_quantization`.

A config arrives as ``None`` / ``"none"``, a method name, a JSON text, a path to a JSON file, a
dict (flat, with ``method`` or ``quant_method``, or per-component: one entry per Wan expert plus
``default``), or an already built config. Flat dicts become a method config
(:mod:`.methods`); per-component dicts a :class:`ComponentConfigs`. Errors are ``ValueError`` (bad
content) or ``TypeError`` (a value of the wrong Python type), and name what to change.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .keys import method_of_mapping, show_value
from .methods import CONFIG_CLASSES, CONFIG_TYPES, SUPPORTED_METHODS, QuantConfig, config_class
from .names import check_component_names


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
            raise TypeError(f"components must be a mapping, got {show_value(self.components)}.")
        for name, config in [*self.components.items(), ("default", self.default)]:
            if not isinstance(name, str) or not name:
                raise ValueError(f"A component name must be a non-empty string, got {show_value(name)}.")
            if config is not None and not isinstance(config, CONFIG_TYPES):
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
        check_component_names(self.components, known)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able per-component dict that :func:`parse_quantization` turns back into this."""
        out = {name: None if c is None else c.to_dict() for name, c in self.components.items()}
        out["default"] = None if self.default is None else self.default.to_dict()
        return out


def parse_quantization(spec: Any) -> QuantConfig | ComponentConfigs | None:
    """Parse any user spelling of a quantization config.

    ``spec`` is ``None`` or ``"none"`` (no config), a method name (``"mxfp4"``, ``"mxfp4_dualscale"``),
    a JSON string or a path to a JSON file, a dict (flat, with ``method`` / ``quant_method``, or
    per-component: ``{"transformer": ..., "transformer_2": ..., "default": ...}``), or an existing
    config. Errors are ValueError (bad content) or TypeError (a value of the wrong Python type).
    """
    if spec is None or isinstance(spec, (ComponentConfigs, *CONFIG_TYPES)):
        return spec
    if isinstance(spec, str):
        return _parse_string(spec)
    if isinstance(spec, Mapping):
        return _parse_mapping(spec)
    raise TypeError(
        f"A quantization config must be None, a method name, a JSON string or file, or a dict; got {show_value(spec)}."
    )


def _read_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from None


def _parse_method_name(text: str) -> QuantConfig | None:
    """``"none"`` or a method name (any case) as a default config."""
    method = text.strip().lower()
    return None if method == "none" else config_class(method)()


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
    """A flat config (it names a method) or a per-component one (its keys are component names)."""
    for name in spec:
        if not isinstance(name, str):
            raise TypeError(
                f"Quantization config keys must be strings (component names or config keys), got the "
                f"{type(name).__name__} {show_value(name)} (its value: {show_value(spec[name])}); quote it."
            )
    method = method_of_mapping(spec, "the quantization config")
    if method is not None:
        return config_class(method).from_dict(spec)
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
    return _parse_components(spec)


def _parse_component(name: str, value: Any) -> QuantConfig | None:
    """One entry of a per-component config; errors name the component."""
    if not name:
        raise ValueError(
            f"Per-component quantization config: a component name must be a non-empty string (a component "
            f"of the pipeline, e.g. 'transformer', or 'default'), got {show_value(name)}."
        )
    if value is not None and not isinstance(value, (str, Mapping, *CONFIG_TYPES)):
        raise ValueError(
            f"Per-component quantization config: the value of {name!r} must be a method name, a dict "
            f"or null, got {show_value(value)}. A flat config needs a 'method' key."
        )
    try:
        config = _parse_method_name(value) if isinstance(value, str) else parse_quantization(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"Per-component quantization config, component {name!r}: {exc}") from None
    if isinstance(config, ComponentConfigs):
        raise ValueError(
            f"Per-component quantization config: {name!r} cannot hold per-component configs (its value "
            f"{show_value(value)} names components, not a method); give it a method name or a dict with 'method'."
        )
    return config


def _parse_components(spec: Mapping[str, Any]) -> ComponentConfigs:
    components = {name: _parse_component(name, value) for name, value in spec.items()}
    default = components.pop("default", None)
    return ComponentConfigs(components, default)
