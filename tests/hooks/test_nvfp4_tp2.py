"""TP=2 for real on an NVFP4 checkpoint: two gloo ranks build vLLM-Omni's Wan2.2 expert from the ModelOpt
export with swizzled scales, with ``mxfp4``. Each rank requantizes whole layers and shards the MXFP4
result as it shards an offline checkpoint: column-parallel Q/K/V by heads, row-parallel ``to_out`` and
``ffn.net_2`` by K. Each rank's tensors must be exactly its slice of the reference's TP=1 bytes.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.nvfp4.checkpoints import fixture_tensors, reference_mxfp4, reference_values
from tests.support.tp_ranks import run_ranks

pytestmark = [pytest.mark.omni, pytest.mark.slow]

SHOWN = ("blocks.0.attn1.to_qkv", "blocks.0.attn1.to_out", "blocks.0.ffn.net_2")


def _rank_run(rank: int, world: int, env, fixture: str, tmp: str):
    """One rank: its MXFP4 tensors of :data:`SHOWN` and the expert's output (sent by value)."""
    from pathlib import Path

    from tests.support.nvfp4.checkpoints import build_via_pipeline, model_dir_with

    model = build_via_pipeline(env, model_dir_with(Path(tmp) / f"rank{rank}", fixture), {"method": "mxfp4"})
    layers = {name: model.get_submodule(name) for name in SHOWN}
    tensors = {
        n: (m.weight.data.numpy().copy(), m.weight_scale.data.numpy().copy()) for n, m in layers.items()
    }
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(1, 4, 3, 8, 8, generator=g).to(torch.bfloat16)
    ehs = torch.randn(1, 16, 32, generator=g).to(torch.bfloat16)
    with env.context(), torch.no_grad():
        out = model(
            hidden_states=hs, timestep=torch.tensor([500]), encoder_hidden_states=ehs, return_dict=False
        )[0]
    return tensors, out.float().numpy().copy()


def _run(world: int, fixture: str, tmp: str) -> dict:
    """Every rank's tensors and output, back as torch tensors (numpy over the queue: sent by value)."""
    got = run_ranks(world, _rank_run, fixture, tmp)
    return {
        rank: ({n: tuple(map(torch.from_numpy, t)) for n, t in tensors.items()}, torch.from_numpy(out))
        for rank, (tensors, out) in got.items()
    }


def _column_shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a fused Q/K/V tensor over 2 ranks (one head of two per part)."""
    return torch.cat([part.chunk(2)[rank] for part in t.chunk(3)])


def _expected(layers: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """TP=1 MXFP4 weight and scales of a runtime Linear made of checkpoint ``layers`` (the reference's)."""
    stored = fixture_tensors("nvfp4")  # the swizzled export holds the same weights, scales unswizzled
    parts = [reference_mxfp4(reference_values(stored, layer), "mse") for layer in layers]
    return torch.cat([w for w, _ in parts]), torch.cat([s for _, s in parts])


def test_each_rank_holds_its_slice_of_the_requantized_swizzled_layers(tmp_path):
    """Swizzled scales: each rank requantizes whole layers, so the 128x4 tiles are undone before sharding."""
    two = _run(2, "swizzled", str(tmp_path))
    qkv = _expected([f"blocks.0.attn1.{p}" for p in ("to_q", "to_k", "to_v")])
    rows = {"blocks.0.attn1.to_out": _expected(["blocks.0.attn1.to_out.0"])}
    rows["blocks.0.ffn.net_2"] = _expected(["blocks.0.ffn.net.2"])
    for rank, (tensors, out) in two.items():
        weight, scale = tensors["blocks.0.attn1.to_qkv"]
        assert torch.equal(weight, _column_shard(qkv[0], rank)) and torch.equal(
            scale, _column_shard(qkv[1], rank)
        )
        for name, (full_weight, full_scale) in rows.items():
            weight, scale = tensors[name]
            assert torch.equal(weight, full_weight.chunk(2, dim=1)[rank]), name
            assert torch.equal(scale, full_scale.chunk(2, dim=1)[rank]), name
        assert torch.isfinite(out).all()
    assert torch.equal(two[0][1], two[1][1])  # both ranks hold the all-reduced output
