"""The demo's bad configuration (vllm_omni_mxfp4_tiny/naive_w4a4.py): every plain Linear computes
W4A4 MXFP4, checked against MXFP4 values built here from the E2M1 grid."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_mxfp4_tiny.naive_w4a4 import quantize_plain_linears

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _on_grid(x: torch.Tensor) -> bool:
    """Whether every 32-block of ``x``'s last dim is a power of two times E2M1 values."""
    blocks = x.reshape(-1, 32).abs()
    for block in blocks:
        nonzero = block[block > 0]
        if not len(nonzero):
            continue
        # the block's scale is a power of two: some 2^e makes every value an E2M1 value
        found = False
        for e in range(-20, 20):
            scaled = nonzero / 2.0**e
            if torch.isin(scaled, E2M1).all():
                found = True
                break
        if not found:
            return False
    return True


def test_plain_linears_compute_w4a4_and_their_names_are_returned():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"embed": torch.nn.Linear(64, 32), "proj_out": torch.nn.Linear(32, 8)})
    original = {name: m.weight.detach().clone() for name, m in model.items()}
    x = torch.randn(5, 64)
    before = model["embed"](x)
    assert quantize_plain_linears(model) == ["embed", "proj_out"]
    for name, module in model.items():
        assert _on_grid(module.weight.detach()), name
        assert not torch.equal(module.weight, original[name])
        assert (module.weight - original[name]).abs().max() < 0.25 * original[name].abs().max()
    after = model["embed"](x)
    # the input is rounded to MXFP4 too: the output is the product of two on-grid operands
    seen = {}
    model["embed"].register_forward_hook(lambda m, args, out: seen.update(x=args[0]))
    model["embed"](x)
    assert _on_grid(seen["x"]) and not torch.equal(seen["x"], x)
    expected = torch.nn.functional.linear(seen["x"], model["embed"].weight, model["embed"].bias)
    assert torch.allclose(after, expected, atol=1e-5)
    assert not torch.allclose(after, before, atol=1e-3)


def test_a_linear_whose_k_is_no_multiple_of_32_is_refused_by_name():
    model = torch.nn.ModuleDict({"ok": torch.nn.Linear(64, 8), "odd": torch.nn.Linear(40, 8)})
    weight = model["ok"].weight.detach().clone()
    with pytest.raises(ValueError, match=r"odd: in_features 40 is not a multiple of 32"):
        quantize_plain_linears(model)
    assert torch.equal(model["ok"].weight, weight) and not model["ok"]._forward_pre_hooks  # nothing changed
