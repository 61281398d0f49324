"""A component's checkpoint directory against the model vLLM-Omni built from it, before any weight loads.

:func:`~.names.check_built_model` reads the directory of every component built with one of our
configs (:meth:`CheckpointDir.read`: ``config.json``, safetensors headers, the merges' description)
and runs :meth:`CheckpointDir.check` before it checks the layer names, in this order:

1. storage against config: an online config of ours (``config.json`` without ``quantization_config``,
   with a method name only, or with the serialized flag false) over pre-quantized tensors is refused
   naming both, before anything that config would trip over (``num_bf16_fallback_layers`` larger
   than the blocks, a tensor at load) hides the cause;
2. ``config.json`` against the weights: each top-level block list vLLM-Omni built from
   ``config.json`` (``blocks``, ``transformer_blocks``...) has exactly the blocks the weights hold.
   Extra blocks in the weights would be skipped with a warning by vLLM-Omni's loader; missing ones
   would fail later as a list of unloaded parameters;
3. the description both merges write (``quant_model_description.json``): every tensor of a Linear it
   lists is stored, so a DualScale layer whose ``mul_scale`` was lost is not taken for one that
   msModelSlim never smoothed (which loads with identity Smooth).

:attr:`CheckpointDir.contract` is the checkpoint's own ``ignored_layers`` (its storage contract,
:data:`vllm_omni_mxfp4.config.names.STORAGE_RULE`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import spec
from ..config.keys import show_value
from ..config.methods import CONFIG_CLASSES
from ..config.reconcile import checkpoint_ignored_layers
from ..errors import CheckpointError
from ..models.build import block_lists
from ..models.names import block_spans, disagreeing_blocks, layer_count_keys
from ..safetensors_io import TensorRef, diffusers_archive

logger = logging.getLogger(__name__)

DESCRIPTION = "quant_model_description.json"
#: Tensors that only a pre-quantized checkpoint holds (``mul_scale`` alone says nothing about storage).
_QUANTIZED_LEAVES = ("weight_scale", "weight_dual_scale")
#: The tensors of a Linear a description may list (quantized or BF16).
_LINEAR_LEAVES = frozenset(t.name for fmt in spec.FORMATS for t in spec.checkpoint_tensors(fmt))


def _read_config(directory: Path) -> dict[str, Any]:
    try:
        value = json.loads((directory / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # vLLM-Omni read it to build the model; a later reader reports its own problem
    return value if isinstance(value, dict) else {}


def _read_tensors(directory: Path) -> dict[str, TensorRef]:
    try:
        return diffusers_archive(directory)
    except (CheckpointError, OSError):
        return {}  # not diffusers safetensors: vLLM-Omni's loader reports it


def _read_description(directory: Path) -> dict[str, str]:
    """The tensor entries of the description (name -> label); metadata and markers left out."""
    try:
        value = json.loads((directory / DESCRIPTION).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    if not isinstance(value, dict):
        return {}
    return {
        name: label
        for name, label in value.items()
        if isinstance(label, str) and name.rpartition(".")[2] in _LINEAR_LEAVES
    }


def _storage_declared(qc: Any) -> str:
    """What ``config.json``'s ``quantization_config`` says about storage, for the mismatch message."""
    if qc is None:
        return "its config.json has no quantization_config"
    if isinstance(qc, str):
        return f"its config.json's quantization_config is the method name {qc!r}, which states no storage"
    if isinstance(qc, Mapping) and qc.get("quant_method") in CONFIG_CLASSES:
        flag = CONFIG_CLASSES[qc["quant_method"]].serialized_key()
        if flag in qc:
            return f"its config.json's quantization_config sets {flag}: {json.dumps(qc[flag])}"
        return f"its config.json's quantization_config does not set {flag}"
    return f"its config.json's quantization_config is {show_value(qc)}"


@dataclass
class CheckpointDir:
    """What a component's directory holds: ``config.json``, tensor headers, the description."""

    directory: Path
    config: dict[str, Any]
    tensors: dict[str, TensorRef]
    description: dict[str, str] = field(default_factory=dict)

    @classmethod
    def read(cls, directory: Path) -> CheckpointDir:
        """Read ``directory``'s files (headers only); whatever is missing or unreadable is left empty."""
        return cls(directory, _read_config(directory), _read_tensors(directory), _read_description(directory))

    @property
    def contract(self) -> tuple[str, ...]:
        """The ``ignored_layers`` the checkpoint's ``config.json`` states itself."""
        return checkpoint_ignored_layers(self.config.get("quantization_config"))

    def check(self, component: torch.nn.Module, configs: Iterable[Any], model: str) -> None:
        """The checks of the module docstring, in its order; ``ValueError`` naming the directory."""
        self.check_storage(configs)
        self.check_blocks(component, model)
        self.check_description()

    def check_storage(self, configs: Iterable[Any]) -> None:
        """Refuse an online config over pre-quantized tensors."""
        online = [c for c in configs if not c.is_serialized]
        quantized = [
            ref for name, ref in self.tensors.items() if name.rpartition(".")[2] in _QUANTIZED_LEAVES
        ]
        if not online or not quantized:
            return
        dual = any(ref.name.endswith(".weight_dual_scale") for ref in quantized)
        stored = CONFIG_CLASSES["mxfp4_dualscale" if dual else "mxfp4"]
        example = quantized[0]
        declare = {"quant_method": stored.METHOD, stored.serialized_key(): True, "ignored_layers": []}
        raise ValueError(
            f"{self.directory}: the checkpoint stores pre-quantized {stored.METHOD} weights ({len(quantized)} "
            f"scale tensors, e.g. {example.name} {example.dtype} {list(example.shape)}), but "
            f"{_storage_declared(self.config.get('quantization_config'))}, so {online[0].METHOD} would take "
            f"them for BF16 weights to quantize online. Declare the storage in config.json: "
            f'"quantization_config": {json.dumps(declare)} with its BF16 Linears in ignored_layers '
            "(vllm-omni-mxfp4 merge writes this block), then load without a quantization argument."
        )

    def check_blocks(self, component: torch.nn.Module, model: str) -> None:
        """Refuse a ``config.json`` that builds another number of blocks than the weights hold."""
        found = disagreeing_blocks(block_lists(component), self.tensors)
        if found is None:
            return
        path, built, held = found
        raise ValueError(
            f"{self.directory}: config.json and the weights disagree: {model} has {built} {path} as "
            f"config.json says{layer_count_keys(self.config, built)}, but the weights hold {path} "
            f"{block_spans(held)} ({len(held)}). Use the config.json that belongs to these weights, or "
            "correct its layer count (vllm-omni-mxfp4 merge refuses such an original)."
        )

    def check_description(self) -> None:
        """Refuse a Linear tensor the merge's description lists but no weight file holds."""
        for name, label in self.description.items():
            if self.tensors and name not in self.tensors:
                raise ValueError(
                    f"{self.directory / DESCRIPTION}: lists tensor {name!r} ({label}), which no weight file of "
                    f"{self.directory} holds: the weights lost a tensor, or the description belongs to other "
                    "weights. Merge the export again (vllm-omni-mxfp4 merge)."
                )
