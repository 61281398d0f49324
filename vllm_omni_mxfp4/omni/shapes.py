"""Load-time refusal of Linears whose shape our formats cannot hold.

Packed FP4 stores two inputs per byte (checkpoint ``weight`` (N, K/2)), so a Linear (or its
tensor-parallel shard) with an odd input size K cannot be quantized at all. Any other K is held: a
K that is not a multiple of the scale block (32, or DualScale's 512) gets a last, partial block that
the kernels pad with zeros. The refusal runs in ``create_weights``, before any allocation, and names
the layer, its K and the fix, instead of letting a kernel fail on a shape later.
"""

from __future__ import annotations


def check_quantizable(prefix: str, method: str, k: int, k_full: int, tp_size: int) -> None:
    """Refuse Linear ``prefix`` when ``method`` cannot hold its K per partition ``k``.

    ``k_full`` is the layer's whole input size and ``tp_size`` the tensor-parallel size it is split
    over (1 when it is not row-parallel), both for the message: an even ``k_full`` split into odd
    shards is fixed by another TP size as well as by BF16.
    """
    if k % 2 == 0:
        return
    split = f" ({k_full} over tensor-parallel size {tp_size})" if k != k_full else ""
    tp_fix = (
        f", or use a tensor-parallel size that splits K={k_full} into even shards"
        if k_full % 2 == 0 and k != k_full
        else ""
    )
    raise ValueError(
        f"{prefix}: {method} cannot quantize this Linear: its input size per partition is K={k}{split}, "
        "odd, and packed FP4 stores two inputs per byte (weight (N, K/2)). Keep it in BF16: add "
        f"{prefix!r} to ignored_layers (its runtime name, relative to its transformer){tp_fix}."
    )
