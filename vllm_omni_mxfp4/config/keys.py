"""The keys of a quantization config: how each is declared, validated, and what role it plays.

A method's config (:mod:`.methods`) is a frozen dataclass whose fields are its keys. Each key is
one line, :func:`key`, that gives its default, its validator and its :class:`Role`, e.g.
``ignored_layers: tuple[str, ...] = key((), check_layers, role=STORAGE)``.

A validator takes the key (as the user spelled it, for the message) and the raw value, and returns
the normalized value (lists become sorted, deduplicated tuples) or raises ``ValueError`` naming the
key, what was expected and, where there is one, the fix.

The role says how the key takes part in the checkpoint contract: whether a checkpoint's
``quantization_config`` carries it (:meth:`~.methods.MethodConfig.to_checkpoint_dict`), and which
side's value survives when vLLM-Omni rebuilds a runtime config from a checkpoint's
(:func:`~.reconcile.reconcile_with_checkpoint`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from vllm_omni_mxfp4.spec import BACKENDS as HARDWARE_BACKENDS
from vllm_omni_mxfp4.spec import REQUANT_RULES

Validator = Callable[[str, Any], Any]

METHOD_KEYS = ("method", "quant_method")
"""The two spellings of the method name in a dict; aliases that must agree."""

KEY_ALIASES = MappingProxyType({"modules_to_not_convert": "ignored_layers"})
"""Other spellings of a key (vLLM's name) -> the key."""

BACKENDS = ("auto", *HARDWARE_BACKENDS)
"""What a config's ``backend`` accepts: a kernel backend of :data:`vllm_omni_mxfp4.spec.BACKENDS`,
or ``auto`` (``VLLM_OMNI_MXFP4_BACKEND``, else the hardware found, decides)."""

SCALE_RULE_OF_ALG = MappingProxyType({0: "floor", 2: "uos"})
"""``mxfp4_scale_alg`` -> the scale rule of :mod:`vllm_omni_mxfp4.formats` (OCP FLOOR or UOS)."""


# ------------------------------------------------------------------------------------------ roles


def _runtime_value(runtime: Any, checkpoint: Any) -> Any:
    return runtime


def _checkpoint_value(runtime: Any, checkpoint: Any) -> Any:
    return checkpoint


def _either_true(runtime: Any, checkpoint: Any) -> Any:
    return runtime or checkpoint


@dataclass(frozen=True)
class Role:
    """What a key means for a checkpoint.

    ``in_checkpoint``: a checkpoint's ``quantization_config`` carries the key (the merge writes it).
    ``rebuilt(runtime, checkpoint)``: the key's value when a runtime config is rebuilt from a
    checkpoint's config, as vLLM-Omni's ``resolve_quant_config_from_disk`` does.
    """

    name: str
    in_checkpoint: bool
    rebuilt: Callable[[Any, Any], Any]


SERIALIZED_FLAG = Role("serialized flag", True, _checkpoint_value)
"""Whether the checkpoint holds pre-quantized weights; one per method, named differently."""

STORAGE = Role("storage", True, _checkpoint_value)
"""How the checkpoint is stored (which layers stayed BF16): the checkpoint decides."""

REQUIREMENT = Role("requirement", True, _either_true)
"""A requirement on the checkpoint's tensors: true if either the runtime or the checkpoint sets it."""

RUNTIME_POLICY = Role("runtime policy", False, _runtime_value)
"""How to run the stored weights (W4A8 lists, activation scale rule): the runtime decides, even with
an explicit empty list."""

RUNTIME_SETTING = Role("runtime setting", False, _checkpoint_value)
"""Other runtime keys: a rebuild takes the checkpoint config's value or the default."""


def key(default: Any, check: Validator, *, role: Role) -> Any:
    """A config key: a dataclass field with its default, its validator and its role."""
    return field(default=default, metadata={"check": check, "role": role})


@dataclass(frozen=True)
class EmptyOnlyKey:
    """A key of the other method that is accepted only empty (so that a config written with empty
    lists still loads); a non-empty value is refused with ``reason``, which says what to do."""

    check: Validator
    reason: str


def empty_only_keys(reason: str, **checks: Validator) -> Mapping[str, EmptyOnlyKey]:
    """The empty-only keys of a method, all refused with the same ``reason``."""
    return MappingProxyType({name: EmptyOnlyKey(check, reason) for name, check in checks.items()})


# ------------------------------------------------------------------------------------- messages


def show_value(value: object, limit: int = 120) -> str:
    """``repr`` of a user value, shortened for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def unknown_name_error(
    name: object, valid: Iterable[str], what: str, valid_label: str = "Valid keys", where: str = ""
) -> ValueError:
    """``Unknown <what> 'name'<where>. Did you mean ...? <valid_label>: ...`` (difflib's suggestion)."""
    valid = sorted(valid)
    hint = ""
    if isinstance(name, str):
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"Unknown {what} {show_value(name)}{where}.{hint} {valid_label}: {', '.join(valid)}.")


# ----------------------------------------------------------------------------------- validators


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool`` (JSON ``true`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be a boolean (true or false), got {show_value(value)}.")
    return value


def check_count(key: str, value: object) -> int:
    if not is_int(value) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {show_value(value)}.")
    return value


def check_scale_alg(key: str, value: object) -> int:
    if not is_int(value) or value not in SCALE_RULE_OF_ALG:
        raise ValueError(
            f"{key} must be 0 (OCP MX) or 2 (UOS with dst_type_max=7.25). Got {show_value(value)}."
        )
    return value


def check_backend(key: str, value: object) -> str:
    if not isinstance(value, str) or value not in BACKENDS:
        valid = ", ".join(repr(b) for b in BACKENDS)
        raise ValueError(f"{key} must be one of {valid}, got {show_value(value)}.")
    return value


NVFP4_REQUANT_RULES = ("auto", *REQUANT_RULES)
"""Values of ``nvfp4_requant_rule``: ``auto`` (the most accurate rule the backend runs: ``mse``, since
weights are data to every kernel) or a rule of ``vllm_omni_mxfp4.formats.requant.REQUANT_RULES``."""


def check_requant_rule(key: str, value: object) -> str:
    if not isinstance(value, str) or value not in NVFP4_REQUANT_RULES:
        valid = ", ".join(repr(r) for r in NVFP4_REQUANT_RULES)
        raise ValueError(f"{key} must be one of {valid}, got {show_value(value)}.")
    return value


def check_steps(key: str, value: object) -> tuple[int, ...]:
    """A list of denoise-loop indices; ``None`` means none. Deduplicated and sorted."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(is_int(s) and s >= 0 for s in value):
        raise ValueError(
            f"{key} must be a list of non-negative integer denoise step indices. Got {show_value(value)}."
        )
    return tuple(sorted(set(value)))


_LAYER_PATH = re.compile(r"[A-Za-z_][A-Za-z_0-9]*(\.[A-Za-z_0-9]+)*")
_WILDCARD_CHARS = frozenset("*?[]{}^$+|()\\")
_EXPERT_PREFIX = re.compile(r"transformer(_\d+)?\.")
_SPLIT_SELF_ATTENTION = re.compile(r"(?:^|\.)attn1\.to_[qkv]$")
_TENSOR_NAMES = ("weight", "bias", "weight_scale", "weight_dual_scale", "mul_scale")


def layer_path_problem(name: object) -> str | None:
    """Why ``name`` is not an exact runtime Linear path relative to an expert, or ``None``."""
    if not isinstance(name, str):
        return f"Entry {show_value(name)} is not a string."
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


def layer_order(path: str) -> tuple:
    """Sort key of layer paths that puts ``blocks.2`` before ``blocks.10`` (as the merge writes them).

    The path itself breaks ties (``blocks.01`` / ``blocks.1``), so that the order never depends on
    the order the names were given in.
    """
    numbered = tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path))
    return numbered, path


def check_layers(key: str, value: object) -> tuple[str, ...]:
    """A list of exact runtime Linear paths; ``None`` means none. Deduplicated, in block order."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"{key} must be a list of non-empty exact runtime Linear paths. Got {show_value(value)}, not a list."
        )
    for name in value:
        problem = layer_path_problem(name)
        if problem is not None:
            raise ValueError(f"{key} must be a list of non-empty exact runtime Linear paths. {problem}")
    return tuple(sorted(set(value), key=layer_order))


def check_low_rank_layers(key: str, value: object) -> dict[str, int]:
    """The stored low-rank pairs of a pre-quantized checkpoint: ``{runtime Linear path: rank}`` (the
    merge writes it from msModelSlim's ``svd_res`` export); ``None`` means none. In block order."""
    if value is None:
        return {}
    shape = f"{key} must be an object mapping exact runtime Linear paths to ranks (integers >= 1)"
    if not isinstance(value, Mapping):
        raise ValueError(f"{shape}, as the merge writes it. Got {show_value(value)}.")
    for name, rank in value.items():
        problem = layer_path_problem(name)
        if problem is not None:
            raise ValueError(f"{shape}. {problem}")
        if not is_int(rank) or rank < 1:
            raise ValueError(f"{shape}. Entry {name!r} has rank {show_value(rank)}.")
    return {name: value[name] for name in sorted(value, key=layer_order)}


ONLINE_ROTATION_FIELDS = ("layers", "applied", "reason")


def check_online_rotation(key: str, value: object) -> dict[str, Any] | None:
    """The merge's record of msModelSlim online Q/K rotations left unapplied (informational, so that a
    checkpoint says what its producer did): ``None``, or ``{"layers": [attention module paths],
    "applied": false, "reason": text}``. Only unapplied rotations exist: the runtime applies none."""
    if value is None:
        return None
    shape = (
        f"{key} must be null or an object with keys layers (attention module paths), applied (false) "
        "and reason (text), as the merge writes it"
    )
    if not isinstance(value, Mapping) or sorted(value) != sorted(ONLINE_ROTATION_FIELDS):
        raise ValueError(f"{shape}. Got {show_value(value)}.")
    layers = check_layers(f"{key}.layers", value["layers"])
    if value["applied"] is not False:
        raise ValueError(
            f"{key}.applied must be false: vllm-omni-mxfp4 applies no online rotation (the merge accepts "
            f"only rotations that serving without them keeps exact). Got {show_value(value['applied'])}."
        )
    reason = value["reason"]
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(f"{shape}. Its reason {show_value(reason)} is not a non-empty string.")
    return {"layers": list(layers), "applied": False, "reason": reason}


def merge_alias(name: str, first: tuple, second: tuple) -> tuple:
    """Two spellings of one list key (e.g. ``modules_to_not_convert``): one may be empty, else equal."""
    if first and second and first != second:
        aliases = " / ".join([name, *(alias for alias, target in KEY_ALIASES.items() if target == name)])
        raise ValueError(
            f"{aliases} are aliases and must agree when both are non-empty: {list(first)} vs {list(second)}."
        )
    return first or second


# -------------------------------------------------------------------------------- method names


def method_name(value: object, where: str) -> str:
    """A method name as given (any case, surrounding blanks), normalized."""
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string naming a quantization method, got {show_value(value)}.")
    return value.strip().lower()


def method_of_mapping(spec: Mapping, where: str) -> str | None:
    """The method named by ``method`` / ``quant_method`` (aliases that must agree), or ``None``."""
    named = {k: method_name(spec[k], f"{where} {k!r}") for k in METHOD_KEYS if k in spec}
    if len(set(named.values())) > 1:
        raise ValueError(
            f"Conflicting quantization method keys in {where}: method={spec['method']!r} vs "
            f"quant_method={spec['quant_method']!r}. They are aliases and must agree."
        )
    return next(iter(named.values()), None)
