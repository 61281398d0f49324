"""Fixtures the tests of the quantized Linears share."""

from __future__ import annotations

import pytest


@pytest.fixture
def as_rank(monkeypatch):
    """``as_rank(r, t)``: vLLM's parallel Linears built next are the ones rank ``r`` of a TP=``t`` run
    owns (they read their rank and world size when they are built)."""
    import vllm.model_executor.layers.linear as linear

    def set_rank(rank: int, size: int) -> None:
        monkeypatch.setattr(linear, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(linear, "get_tensor_model_parallel_world_size", lambda: size)

    return set_rank
