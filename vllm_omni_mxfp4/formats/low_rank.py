"""A weight's rank-r approximation, the 16-bit branch kept next to its quantized residual.

A Linear ``y = x W^T`` becomes ``y = x R^T + (x L1^T) L2^T`` with ``W ~ L2 @ L1 + R``: the pair
``L1`` ``(r, K)`` and ``L2`` ``(N, r)`` holds the weight's largest singular directions in the
activation dtype, and only the residual ``R`` is quantized. The outliers that make a weight hard to
quantize sit mostly in those directions, so the residual has a smaller range per block than ``W``
(SVDQuant's argument). The pair's names and layout are msModelSlim's ``svd_res`` processor's:
``svd_lowrank_l1 = V^T`` and ``svd_lowrank_l2 = U * S``.

The decomposition is :func:`torch.svd_lowrank` (a randomized SVD, as msModelSlim's processor uses),
with oversampling and power iterations for accuracy and a fixed seed, so that every TP rank and
every load computes the same pair from the same weight. It runs in float32 on the CPU: cost
``O(N K r)`` per weight, not the ``O(N K min(N, K))`` of a full SVD.
"""

from __future__ import annotations

import torch

from ..spec import max_low_rank

OVERSAMPLING = 8
"""Extra random directions the randomized SVD draws beyond the rank (its accuracy margin)."""

POWER_ITERATIONS = 4
"""Subspace (power) iterations of the randomized SVD: each sharpens the split between the kept and
the dropped singular values."""

SEED = 0
"""The seed of the randomized SVD's test matrix: the pair is a function of the weight alone."""


def low_rank_pair(
    weight: torch.Tensor, rank: int, where: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L1, L2)`` float32 on the CPU, ``L1`` ``(rank, K)`` and ``L2`` ``(N, rank)``, whose product
    approximates ``weight`` ``(N, K)`` by its ``rank`` largest singular directions.

    ``where`` names the tensor in errors. ``rank`` must lie in ``[1, min(N, K)]`` and the weight
    must be finite. The global random state is left as it was.
    """
    if weight.dim() != 2:
        raise ValueError(
            f"{where}: a low-rank branch needs a 2-D weight (N, K), got shape {tuple(weight.shape)}"
        )
    n, k = weight.shape
    if not 0 < rank <= max_low_rank(n, k):
        raise ValueError(
            f"{where}: svd_rank {rank} must lie in [1, min(N, K)] = [1, {max_low_rank(n, k)}] for a weight of shape "
            f"({n}, {k}); use a smaller svd_rank"
        )
    w = weight.detach().to(device="cpu", dtype=torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{where}: the weight holds NaN or infinity; no low-rank branch can be computed")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        u, s, v = torch.svd_lowrank(w, q=min(rank + OVERSAMPLING, n, k), niter=POWER_ITERATIONS)
    return v[:, :rank].T.contiguous(), (u[:, :rank] * s[:rank]).contiguous()


def split_weight(
    weight: torch.Tensor, rank: int, where: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(L1, L2, residual)``: :func:`low_rank_pair` of ``weight`` and ``weight - L2 @ L1`` in
    ``weight``'s dtype and device (the part that is quantized)."""
    l1, l2 = low_rank_pair(weight, rank, where)
    residual = weight.detach().to(device="cpu", dtype=torch.float32) - l2 @ l1
    return l1, l2, residual.to(device=weight.device, dtype=weight.dtype)
