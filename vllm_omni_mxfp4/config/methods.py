"""The configs of the two quantization methods, ``mxfp4`` and ``mxfp4_dualscale``.

Each is a frozen dataclass whose fields are its keys, declared with :func:`.keys.key` (default,
validator, role on one line); :class:`MethodConfig` holds what both share: validation, strict
dict parsing, serialization (the whole config, or the checkpoint's storage contract) and routing.
Adding a key is adding one field line; adding a method is adding one class to
:data:`CONFIG_CLASSES`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import Field, dataclass, fields
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, TypeVar

from .keys import (
    KEY_ALIASES,
    METHOD_KEYS,
    REQUIREMENT,
    RUNTIME_POLICY,
    RUNTIME_SETTING,
    SCALE_RULE_OF_ALG,
    SERIALIZED_FLAG,
    STORAGE,
    EmptyOnlyKey,
    Role,
    check_backend,
    check_bool,
    check_count,
    check_layers,
    check_low_rank_layers,
    check_online_rotation,
    check_requant_rule,
    check_scale_alg,
    check_steps,
    empty_only_keys,
    key,
    layer_order,
    merge_alias,
    method_of_mapping,
    show_value,
    unknown_name_error,
)
from .routing import LayerRoute, Precision

ConfigT = TypeVar("ConfigT", bound="MethodConfig")

_BLOCK_INDEX = re.compile(r"^blocks\.(\d+)\.")


def _role(f: Field) -> Role:
    return f.metadata["role"]


class MethodConfig:
    """What the configs of both methods share.

    A subclass is a frozen dataclass that sets ``METHOD`` (its vLLM-Omni method name), declares its
    keys as fields with :func:`.keys.key` (exactly one with role ``SERIALIZED_FLAG``) and may set
    ``EMPTY_ONLY_KEYS`` (keys of the other method it accepts only empty).
    """

    METHOD: ClassVar[str]
    EMPTY_ONLY_KEYS: ClassVar[Mapping[str, EmptyOnlyKey]] = MappingProxyType({})
    #: Keys written by :meth:`to_dict` only when non-empty, so that a config that does not use them
    #: serializes (and writes its checkpoint block) exactly as before they existed.
    OMITTED_WHEN_EMPTY: ClassVar[tuple[str, ...]] = (
        "mxfp8_layers",
        "online_rotation",
        "svd_rank",
        "svd_lowrank_layers",
    )

    ignored_layers: tuple[str, ...]
    mxfp8_layers: tuple[str, ...]
    svd_rank: int
    svd_lowrank_layers: dict[str, int]

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))
        self._check_combination()
        self._check_mxfp8_layers()
        self._check_svd_rank()
        self._check_svd_lowrank_layers()

    def _check_svd_lowrank_layers(self) -> None:
        """``svd_lowrank_layers`` describes the low-rank pairs a pre-quantized checkpoint stores: offline
        only, each on a quantized MXFP4 Linear (not BF16, not MXFP8)."""
        listed = self.svd_lowrank_layers
        if not listed:
            return
        if not self.is_serialized:
            raise ValueError(
                f"svd_lowrank_layers {dict(listed)} names low-rank pairs that a pre-quantized checkpoint stores, "
                f"but this {self.METHOD} config is online (it quantizes BF16 weights at load). For an "
                f"msModelSlim svd_res export set {self.serialized_key()}: true (vllm-omni-mxfp4 merge writes both "
                "keys); to compute a branch from BF16 weights at load use svd_rank instead."
            )
        for other, why in (
            (
                "ignored_layers",
                "keeps them in BF16, and a BF16 Linear has its whole weight: it takes no pair",
            ),
            ("mxfp8_layers", "stores them as MXFP8 W8A8, which has no low-rank branch"),
        ):
            both = sorted(set(listed) & set(getattr(self, other)), key=layer_order)
            if both:
                raise ValueError(
                    f"{both} are listed in svd_lowrank_layers and in {other}, which {why}. Fix the checkpoint's "
                    "quantization_config (vllm-omni-mxfp4 merge writes these lists from the export)."
                )

    def _check_svd_rank(self) -> None:
        """``svd_rank`` splits BF16 weights at load (online); a pre-quantized checkpoint has no BF16
        weight left to split."""
        if self.svd_rank and self.is_serialized:
            raise ValueError(
                f"svd_rank {self.svd_rank} computes a low-rank branch from the BF16 weights at load (online "
                f"{self.METHOD}), but this config loads a pre-quantized checkpoint ({self.serialized_key()}: "
                "true), whose weights are already quantized. Remove svd_rank, or load the BF16 model with "
                f"--quantization {self.METHOD} and svd_rank."
            )

    def _check_mxfp8_layers(self) -> None:
        """``mxfp8_layers`` describes a pre-quantized checkpoint's storage: offline only, and each of
        its layers neither BF16 (``ignored_layers``) nor W4A8 (``w4a8_fallback_layers``)."""
        listed = self.mxfp8_layers
        if listed and not self.is_serialized:
            raise ValueError(
                f"mxfp8_layers {list(listed)} names layers that a pre-quantized checkpoint stores as MXFP8 "
                f"W8A8, but this {self.METHOD} config is online (it quantizes BF16 weights at load), and "
                f"online quantization to MXFP8 is not supported. For a pre-quantized checkpoint set "
                f"{self.serialized_key()}: true (vllm-omni-mxfp4 merge writes both keys); otherwise remove "
                "mxfp8_layers (list those layers in ignored_layers to keep them in BF16)."
            )
        both = self._also_in_mxfp8_layers("ignored_layers")
        if both:
            raise ValueError(
                f"{both} are listed in mxfp8_layers and in ignored_layers, which stores them in BF16: a layer "
                "has one storage format. Fix the checkpoint's quantization_config (vllm-omni-mxfp4 merge writes "
                "both lists)."
            )
        both = self._also_in_mxfp8_layers("w4a8_fallback_layers")
        if both:
            raise ValueError(
                f"{both} are listed in mxfp8_layers and in w4a8_fallback_layers, but W4A8 fallback does not "
                "apply to MXFP8 layers (their weights are 8-bit; they run W8A8). Remove them from "
                "w4a8_fallback_layers."
            )

    def _also_in_mxfp8_layers(self, key: str) -> list[str]:
        """The entries of layer list ``key`` that ``mxfp8_layers`` lists too, in block order."""
        return sorted(set(self.mxfp8_layers) & set(getattr(self, key, ())), key=layer_order)

    def _check_combination(self) -> None:
        """Rules that involve several keys; none by default."""

    # Keys ------------------------------------------------------------------------------------------

    @classmethod
    def keys_with_role(cls, role: Role) -> tuple[str, ...]:
        """The keys (field names) of this method that have ``role``."""
        return tuple(f.name for f in fields(cls) if _role(f) is role)

    @classmethod
    def serialized_key(cls) -> str:
        """The name of this method's serialized-weights flag (it differs between the methods)."""
        (name,) = cls.keys_with_role(SERIALIZED_FLAG)
        return name

    @classmethod
    def valid_keys(cls) -> tuple[str, ...]:
        """Every key a dict for this method may hold (fields, aliases, method keys, empty-only keys)."""
        names = [f.name for f in fields(cls)]
        aliases = [alias for alias, target in KEY_ALIASES.items() if target in names]
        return (*METHOD_KEYS, *names, *aliases, *cls.EMPTY_ONLY_KEYS)

    @property
    def is_serialized(self) -> bool:
        """Whether the weights are pre-quantized in the checkpoint (offline mode)."""
        return getattr(self, self.serialized_key())

    # Dicts -----------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls: type[ConfigT], d: Mapping[str, Any]) -> ConfigT:
        """Build from a dict (inline spec or checkpoint ``quantization_config``); strict on keys."""
        if not isinstance(d, Mapping):
            raise TypeError(f"A {cls.METHOD!r} quantization config must be a dict, got {show_value(d)}.")
        method = method_of_mapping(d, f"the {cls.METHOD!r} quantization config")
        if method is not None and method != cls.METHOD:
            raise ValueError(
                f"Quantization config declares method {method!r}, expected {cls.METHOD!r} for {cls.__name__}."
            )
        fields_by_name = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for given, value in d.items():
            if given in METHOD_KEYS:
                continue
            name = KEY_ALIASES.get(given, given) if isinstance(given, str) else given
            if name in fields_by_name:
                value = fields_by_name[name].metadata["check"](given, value)
                kwargs[name] = merge_alias(name, kwargs[name], value) if name in kwargs else value
            elif given in cls.EMPTY_ONLY_KEYS:
                empty_only = cls.EMPTY_ONLY_KEYS[given]
                if empty_only.check(given, value):
                    raise ValueError(empty_only.reason)
            else:
                what = f"key in the {cls.METHOD!r} quantization config:"
                raise unknown_name_error(given, cls.valid_keys(), what)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict with ``quant_method`` that :meth:`from_dict` turns back into this config."""
        out: dict[str, Any] = {"quant_method": self.METHOD}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in self.OMITTED_WHEN_EMPTY and not value:
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_checkpoint_dict(self) -> dict[str, Any]:
        """The ``quantization_config`` a checkpoint's ``config.json`` carries: the storage contract only.

        Keys whose role is not ``in_checkpoint`` (W4A8 lists, scale algorithm, backend, leading-block
        rule) stay out, so that the block is exactly the user guide's and auto-detection leaves those
        to the runtime defaults.
        """
        written = {f.name for f in fields(self) if _role(f).in_checkpoint}
        return {k: v for k, v in self.to_dict().items() if k == "quant_method" or k in written}

    def rebuilt_from_checkpoint(self: ConfigT, checkpoint: ConfigT) -> ConfigT:
        """The config vLLM-Omni rebuilds from ``checkpoint`` (the checkpoint's config, same method)
        for this runtime config: every key takes the value its role gives it."""
        values = {
            f.name: _role(f).rebuilt(getattr(self, f.name), getattr(checkpoint, f.name)) for f in fields(self)
        }
        return type(self)(**values)

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
            raise TypeError(f"A layer prefix must be a string, got {show_value(prefix)}.")
        reason = self._bf16_reason(prefix)
        if reason is not None:
            return LayerRoute(Precision.BF16, (), reason, prefix)
        steps = self._w4a8_steps
        if prefix in self.mxfp8_layers:
            note = f"; W4A8 fallback steps {list(steps)} do not apply to MXFP8 layers" if steps else ""
            return LayerRoute(Precision.W8A8, (), f"listed in mxfp8_layers (MXFP8 W8A8){note}", prefix)
        if prefix in self._w4a8_layers:
            return LayerRoute(Precision.W4A8, (), "listed in w4a8_fallback_layers", prefix)
        reason = f"W4A4; W4A8 on denoise steps {list(steps)}" if steps else "W4A4"
        return LayerRoute(Precision.W4A4, steps, reason, prefix)


@dataclass(frozen=True)
class Mxfp4Config(MethodConfig):
    """``mxfp4``: single-scale OCP MXFP4 (E2M1 + one E8M0 scale per 32), online or offline."""

    is_checkpoint_mxfp4_serialized: bool = key(False, check_bool, role=SERIALIZED_FLAG)
    ignored_layers: tuple[str, ...] = key((), check_layers, role=STORAGE)
    mxfp8_layers: tuple[str, ...] = key((), check_layers, role=STORAGE)
    online_rotation: dict[str, Any] | None = key(None, check_online_rotation, role=STORAGE)
    w4a8_fallback_layers: tuple[str, ...] = key((), check_layers, role=RUNTIME_POLICY)
    w4a8_fallback_steps: tuple[int, ...] = key((), check_steps, role=RUNTIME_POLICY)
    require_smooth_scale: bool = key(False, check_bool, role=REQUIREMENT)
    mxfp4_scale_alg: int = key(0, check_scale_alg, role=RUNTIME_POLICY)
    backend: str = key("auto", check_backend, role=RUNTIME_SETTING)
    nvfp4_requant_rule: str = key("auto", check_requant_rule, role=RUNTIME_SETTING)
    svd_rank: int = key(0, check_count, role=RUNTIME_POLICY)
    svd_lowrank_layers: dict[str, int] = key(None, check_low_rank_layers, role=STORAGE)

    METHOD: ClassVar[str] = "mxfp4"

    def _check_combination(self) -> None:
        if self.require_smooth_scale and not self.is_checkpoint_mxfp4_serialized:
            raise ValueError(
                "require_smooth_scale requires an offline MXFP4 checkpoint "
                "(is_checkpoint_mxfp4_serialized=true); online quantization has no calibrated mul_scale."
            )

    @property
    def scale_rule(self) -> str:
        """The MX scale rule of ``vllm_omni_mxfp4.formats``: ``"floor"`` (OCP) or ``"uos"``."""
        return SCALE_RULE_OF_ALG[self.mxfp4_scale_alg]

    @property
    def _w4a8_layers(self) -> tuple[str, ...]:
        return self.w4a8_fallback_layers

    @property
    def _w4a8_steps(self) -> tuple[int, ...]:
        return self.w4a8_fallback_steps


DUALSCALE_HAS_NO_W4A8 = (
    "mxfp4_dualscale does not support W4A8 fallback. Use mxfp4 with single-scale weights; "
    "changing a DualScale checkpoint's method name does not convert its storage format."
)


@dataclass(frozen=True)
class Mxfp4DualScaleConfig(MethodConfig):
    """``mxfp4_dualscale``: per-32 E8M0 + per-512 FP32 scales + ``mul_scale``, online or offline."""

    is_checkpoint_serialized: bool = key(False, check_bool, role=SERIALIZED_FLAG)
    ignored_layers: tuple[str, ...] = key((), check_layers, role=STORAGE)
    mxfp8_layers: tuple[str, ...] = key((), check_layers, role=STORAGE)
    online_rotation: dict[str, Any] | None = key(None, check_online_rotation, role=STORAGE)
    num_bf16_fallback_layers: int = key(5, check_count, role=RUNTIME_SETTING)
    backend: str = key("auto", check_backend, role=RUNTIME_SETTING)
    svd_rank: int = key(0, check_count, role=RUNTIME_POLICY)
    svd_lowrank_layers: dict[str, int] = key(None, check_low_rank_layers, role=STORAGE)

    METHOD: ClassVar[str] = "mxfp4_dualscale"
    EMPTY_ONLY_KEYS: ClassVar[Mapping[str, EmptyOnlyKey]] = empty_only_keys(
        DUALSCALE_HAS_NO_W4A8, w4a8_fallback_layers=check_layers, w4a8_fallback_steps=check_steps
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
CONFIG_TYPES = (Mxfp4Config, Mxfp4DualScaleConfig)
CONFIG_CLASSES: Mapping[str, type[QuantConfig]] = MappingProxyType({cls.METHOD: cls for cls in CONFIG_TYPES})
SUPPORTED_METHODS = tuple(CONFIG_CLASSES)


class RouteOverride(Protocol):
    """Changes the route of the Linear ``prefix`` (and the config its method gets), for a reason the
    config cannot know: a family's BF16 default, an NVFP4 checkpoint's plan (``omni.routes``)."""

    def override(self, prefix: str, route: LayerRoute, config: QuantConfig) -> tuple[LayerRoute, QuantConfig]:
        """The route and config the Linear ``prefix`` runs with, given those decided so far."""
        ...


def config_class(method: str) -> type[QuantConfig]:
    """The config class of ``method``; ValueError with a suggestion and the supported methods."""
    if method not in CONFIG_CLASSES:
        raise unknown_name_error(
            method, SUPPORTED_METHODS, "quantization method", "Supported", where=" for vllm-omni-mxfp4"
        )
    return CONFIG_CLASSES[method]
