"""The one cosine similarity of the tests: two outputs (tensors or arrays) as flat vectors, in float64."""

from __future__ import annotations

import torch


def cosine(a, b) -> float:
    """Cosine similarity of ``a`` and ``b`` (torch tensors or numpy arrays of the same size), in float64."""
    a, b = torch.as_tensor(a).flatten().double(), torch.as_tensor(b).flatten().double()
    return (a @ b / (a.norm() * b.norm())).item()
