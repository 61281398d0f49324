"""The names in a quantization config, checked against the model that is actually built.

A config is validated twice. When it is parsed (:mod:`.keys`) each layer path must *look* like a
runtime Linear path; only the built model says whether it *is* one. :func:`check_model_names`
takes what vLLM-Omni built (its Linear paths and its block count) and refuses every entry of every
layer list that matches no Linear, with the closest Linear path as a suggestion, and a leading-block
count larger than the model. :func:`check_component_names` does the same for the keys of a
per-component config against the components the pipeline quantizes.

Pure Python: :mod:`vllm_omni_mxfp4.hooks.names` reads the model and calls these from vLLM-Omni's
model construction.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable

from .keys import check_layers, layer_order, show_value
from .methods import QuantConfig


def layer_lists(config: QuantConfig) -> dict[str, tuple[str, ...]]:
    """Every list of Linear paths in ``config`` (``ignored_layers``, ``w4a8_fallback_layers``, ...),
    by key: the fields validated by :func:`.keys.check_layers`."""
    fields = type(config).__dataclass_fields__.values()
    return {f.name: getattr(config, f.name) for f in fields if f.metadata.get("check") is check_layers}


def _unknown_layer(key: str, name: str, linears: Collection[str], model: str) -> ValueError:
    ordered = sorted(linears, key=layer_order)
    close = difflib.get_close_matches(name, ordered, n=1, cutoff=0.8)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    first = ordered[0].split(".")[:2] if ordered else []
    sample = [n for n in ordered if n.split(".")[:2] == first] if first[:1] == ["blocks"] else ordered[:12]
    return ValueError(
        f"{key} entry {name!r} matches no Linear of {model} ({len(ordered)} Linears).{hint} "
        f"List exact runtime Linear paths relative to the transformer, e.g. {', '.join(sample)}."
    )


def check_model_names(
    config: QuantConfig,
    linears: Collection[str],
    num_blocks: int | None,
    *,
    model: str = "the model",
    unverifiable: Iterable[str] = (),
    plain: Collection[str] = (),
) -> None:
    """Refuse layer-list entries that name no Linear of the built model, ``mxfp8_layers`` entries
    naming a plain Linear, and a ``num_bf16_fallback_layers`` larger than its block count.

    ``linears``: the runtime paths of the model's Linear layers (what ``get_quant_method`` saw).
    ``num_blocks``: its number of transformer blocks (``None``: unknown, not checked).
    ``unverifiable``: module prefixes this process did not build (pipeline-parallel slots of other
    ranks); entries under them are left to the rank that builds them.
    ``plain``: those of ``linears`` the model builds as plain ``torch.nn.Linear`` (no quantization
    method: BF16 whatever the config says). Listing one in ``ignored_layers`` is harmless, but an
    ``mxfp8_layers`` entry would load MXFP8 bytes into a BF16 weight.
    """
    skipped = tuple(prefix + "." for prefix in unverifiable)
    for key, names in layer_lists(config).items():
        for name in names:
            if name not in linears and not name.startswith(skipped):
                raise _unknown_layer(key, name, linears, model)
    for name in getattr(config, "mxfp8_layers", ()):
        if name in plain:
            raise ValueError(
                f"mxfp8_layers entry {name!r} is a plain torch.nn.Linear of {model}, which vLLM-Omni builds "
                "without a quantization method: it runs in BF16 and cannot load MXFP8 tensors. Remove it "
                "from mxfp8_layers and store this layer's original BF16 weight."
            )
    leading = getattr(config, "num_bf16_fallback_layers", None)
    if num_blocks is None or leading is None or config.is_serialized or leading <= num_blocks:
        return
    raise ValueError(
        f"num_bf16_fallback_layers={leading} is larger than the {num_blocks} blocks of {model}: online "
        f"{config.METHOD} would keep every block in BF16 (the default is 5). Set it to at most {num_blocks} "
        "(0 quantizes every block)."
    )


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
