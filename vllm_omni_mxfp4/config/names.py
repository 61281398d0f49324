"""The names in a quantization config, checked against the model that is actually built.

A config is validated twice. When it is parsed (:mod:`.keys`) each layer path must *look* like a
runtime Linear path; only the built model says whether it *is* one. :func:`check_model_names`
takes what vLLM-Omni built (its Linear paths and its block count) and refuses every entry of every
layer list that matches no Linear, with the closest Linear path as a suggestion, and a leading-block
count larger than the model. Two rules: a list the user gives must name Linears (:data:`USER_RULE`);
the checkpoint's own ``ignored_layers`` is a storage contract whose entries may also name modules
that are not Linears, which are accepted and reported (:data:`STORAGE_RULE`); an entry that names
nothing is refused under both. :func:`check_component_names` does the same for the keys of a
per-component config against the components the pipeline quantizes.

Pure Python: :mod:`vllm_omni_mxfp4.hooks.names` reads the model and calls these from vLLM-Omni's
model construction.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Mapping

from .keys import check_layers, check_low_rank_layers, layer_order, show_value
from .methods import QuantConfig


def layer_lists(config: QuantConfig) -> dict[str, tuple[str, ...]]:
    """Every list of Linear paths in ``config`` (``ignored_layers``, ``w4a8_fallback_layers``, ...),
    by key: the fields validated by :func:`.keys.check_layers`, and the Linears that
    ``svd_lowrank_layers`` (:func:`.keys.check_low_rank_layers`) gives a rank."""
    fields = type(config).__dataclass_fields__.values()
    checks = (check_layers, check_low_rank_layers)
    return {f.name: tuple(getattr(config, f.name)) for f in fields if f.metadata.get("check") in checks}


STORAGE_RULE = (
    "the checkpoint's own ignored_layers (its config.json): a storage contract, whose entries may also "
    "name modules that are not Linears (norms, embeddings; vLLM-Omni's merge script lists every weight "
    "without a weight_scale), which load as they are"
)
"""The rule for a checkpoint's ``ignored_layers``, in words (``inspect`` and the engine's log say it)."""

USER_RULE = "a list given at load time: every entry must name a Linear of the model"
"""The rule for a layer list the user passes (``Omni(...)``, ``--diffusion-quantization-config``)."""


def _unknown_layer(
    key: str, name: str, linears: Collection[str], model: str, from_checkpoint: bool
) -> ValueError:
    ordered = sorted(linears, key=layer_order)
    close = difflib.get_close_matches(name, ordered, n=1, cutoff=0.8)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    first = ordered[0].split(".")[:2] if ordered else []
    sample = [n for n in ordered if n.split(".")[:2] == first] if first[:1] == ["blocks"] else ordered[:12]
    if from_checkpoint:
        return ValueError(
            f"{key} entry {name!r} of the checkpoint's config.json names neither a Linear nor a module without "
            f"Linears (a norm, an embedding) of {model} ({len(ordered)} Linears).{hint} The checkpoint was "
            "written for another model or its config.json was edited: "
            "re-run vllm-omni-mxfp4 merge on its export, or fix the entry (runtime Linear paths relative "
            f"to the transformer, e.g. {', '.join(sample)})."
        )
    return ValueError(
        f"{key} entry {name!r} matches no Linear of {model} ({len(ordered)} Linears).{hint} "
        f"List exact runtime Linear paths relative to the transformer, e.g. {', '.join(sample)}."
    )


def _check_layer_lists(
    config: QuantConfig,
    linears: Collection[str],
    model: str,
    skipped: tuple[str, ...],
    modules: Mapping[str, str],
    storage: Collection[str],
) -> list[tuple[str, str]]:
    """Every layer-list entry names a Linear, or (a checkpoint's own ``ignored_layers`` entry) a
    module of ``modules``; returns those accepted modules as (entry, class name)."""
    accepted = []
    for key, names in layer_lists(config).items():
        for name in names:
            if name in linears or name.startswith(skipped):
                continue
            from_checkpoint = key == "ignored_layers" and name in storage
            if from_checkpoint and name in modules:
                accepted.append((name, modules[name]))
                continue
            raise _unknown_layer(key, name, linears, model, from_checkpoint)
    return accepted


def check_model_names(
    config: QuantConfig,
    linears: Collection[str],
    num_blocks: int | None,
    *,
    model: str = "the model",
    unverifiable: Iterable[str] = (),
    plain: Collection[str] = (),
    modules: Mapping[str, str] | None = None,
    storage: Collection[str] = (),
) -> list[tuple[str, str]]:
    """Refuse layer-list entries that name no Linear of the built model, ``mxfp8_layers`` and
    ``svd_lowrank_layers`` entries naming a plain Linear, and a ``num_bf16_fallback_layers`` larger than its block count.

    ``linears``: the runtime paths of the model's Linear layers (what ``get_quant_method`` saw).
    ``num_blocks``: its number of transformer blocks (``None``: unknown, not checked).
    ``unverifiable``: module prefixes this process did not build (pipeline-parallel slots of other
    ranks); entries under them are left to the rank that builds them.
    ``plain``: those of ``linears`` the model builds as plain ``torch.nn.Linear`` (no quantization
    method: BF16 whatever the config says). Listing one in ``ignored_layers`` is harmless, but an
    ``mxfp8_layers`` entry would load MXFP8 bytes into a BF16 weight.
    ``modules``: the model's modules that are no Linear and hold none, with their class names.
    ``storage``: the ``ignored_layers`` the checkpoint's own ``config.json`` lists (:data:`STORAGE_RULE`);
    those entries may name one of ``modules``. Every other entry (:data:`USER_RULE`) must name a Linear.

    Returns the accepted non-Linear entries as (entry, class name), for the caller to report.
    """
    skipped = tuple(prefix + "." for prefix in unverifiable)
    accepted = _check_layer_lists(config, linears, model, skipped, modules or {}, storage)
    for key, what in (("mxfp8_layers", "MXFP8 tensors"), ("svd_lowrank_layers", "a low-rank pair")):
        for name in getattr(config, key, ()):
            if name in plain:
                raise ValueError(
                    f"{key} entry {name!r} is a plain torch.nn.Linear of {model}, which vLLM-Omni builds "
                    f"without a quantization method: it runs in BF16 and cannot load {what}. Remove it "
                    f"from {key} and store this layer's original BF16 weight."
                )
    leading = getattr(config, "num_bf16_fallback_layers", None)
    if num_blocks is None or leading is None or config.is_serialized or leading <= num_blocks:
        return accepted
    raise ValueError(
        f"num_bf16_fallback_layers={leading} is larger than the {num_blocks} blocks of {model}: online "
        f"{config.METHOD} would keep every block in BF16 (the default is 5). Set it to at most {num_blocks} "
        "(0 quantizes every block)."
    )


def describe_accepted(accepted: Iterable[tuple[str, str]]) -> str:
    """``8 RMSNorm (blocks.0.attn1.norm_k, ...), 1 Conv3dLayer (patch_embedding)``: accepted
    non-Linear entries by class, for a log line or a report note."""
    by_class: dict[str, list[str]] = {}
    for name, cls in accepted:
        by_class.setdefault(cls, []).append(name)
    parts = []
    for cls, names in sorted(by_class.items(), key=lambda item: -len(item[1])):
        shown = ", ".join(sorted(names, key=layer_order)[:2]) + (", ..." if len(names) > 2 else "")
        parts.append(f"{len(names)} {cls} ({shown})")
    return ", ".join(parts)


def check_component_names(names: Iterable[str], known: Iterable[str], where: str = "") -> None:
    """Refuse per-component keys that are not among ``known`` (``default`` always is), with the
    closest component name as a suggestion."""
    known = sorted(known)
    for name in names:
        if name != "default" and name not in known:
            close = difflib.get_close_matches(name, known, n=1) if isinstance(name, str) else []
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"Unknown component {show_value(name)}{where}.{hint} Known components: {', '.join(known)}. "
                "Each key must name a component exactly (or be 'default'); an unmatched component "
                "would run unquantized."
            )
