"""Edits of a copy of a real msModelSlim export, and the assertion that the merge refuses the result
with a one-line message and writes nothing (helpers of the fault tests)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_omni_mxfp4.checkpoint import CheckpointError, merge

Mutation = Callable[[dict[str, torch.Tensor], dict[str, object]], None]


def edit(expert: Path, mutate: Mutation) -> None:
    """Apply ``mutate(tensors, description)`` to an unsharded export directory."""
    (weights,) = expert.glob("quant_model_weight*.safetensors")
    (description,) = expert.glob("quant_model_description*.json")
    tensors = load_file(str(weights))
    entries = json.loads(description.read_text())
    mutate(tensors, entries)
    save_file(tensors, str(weights))
    description.write_text(json.dumps(entries, indent=4))


def merge_t2v(original: Path, quant: Path, out: Path, **kwargs):
    return merge("Wan2.2-T2V-A14B", original, quant, out, **kwargs)


def assert_refused(expert_copy, tmp_path, message: str, mutate: Mutation | None = None) -> None:
    original, quant = expert_copy
    if mutate is not None:
        edit(quant / "high_noise_model", mutate)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=message) as exc:
        merge_t2v(original, quant, out)
    assert "\n" not in str(exc.value)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if "mxfp4-merge" in p.name]


def drop(*names: str) -> Mutation:
    def mutate(tensors, entries):
        for name in names:
            del tensors[name]
            del entries[name]

    return mutate


def replace(name: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Mutation:
    def mutate(tensors, entries):
        tensors[name] = value(tensors[name]).contiguous()

    return mutate


def relabel(name: str, new: str) -> Mutation:
    def mutate(tensors, entries):
        entries[name] = new

    return mutate
