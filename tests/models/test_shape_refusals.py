"""A Linear whose K packed FP4 cannot hold (odd) is refused when the model is built, naming the layer,
its K and the fix; the fix (the layer in ignored_layers) then builds and runs.

Z-Image's FFN hidden size is int(dim / 3 * 8): dim 512 gives K=1365 for every ``feed_forward.w2``,
a shape a real config could have (the released dim 3840 gives 10240).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.support.models import Z_IMAGE, build, forward, load_from, randomize
from vllm_omni_mxfp4.omni.shapes import check_quantizable

ODD_Z_IMAGE = dataclasses.replace(Z_IMAGE, config=dict(Z_IMAGE.config, dim=512, n_heads=4, n_kv_heads=4))
ODD_LAYERS = [
    "noise_refiner.0.feed_forward.w2",
    "context_refiner.0.feed_forward.w2",
    "layers.0.feed_forward.w2",
]


@pytest.mark.parametrize("method", ["mxfp4", "mxfp4_dualscale"])
def test_odd_k_is_refused_at_build_naming_layer_k_and_fix(vllm_env, method):
    with pytest.raises(ValueError) as err:
        build(vllm_env, ODD_Z_IMAGE, {"quant_method": method})
    msg = str(err.value)
    assert msg.split(":")[0] in ODD_LAYERS, msg
    for fragment in (f"{method} cannot quantize", "K=1365", "odd", "ignored_layers", msg.split(":")[0]):
        assert fragment in msg, (fragment, msg)


def test_listing_the_refused_layers_in_ignored_layers_builds_and_runs(vllm_env):
    ref = build(vllm_env, ODD_Z_IMAGE)
    randomize(ref)
    weights = {name: p.detach().clone() for name, p in ref.named_parameters()}
    model = build(vllm_env, ODD_Z_IMAGE, {"quant_method": "mxfp4", "ignored_layers": ODD_LAYERS})
    load_from(vllm_env, model, weights)
    from vllm_omni_mxfp4.omni.linear import MxLinearMethod

    methods = {n: getattr(m, "quant_method", None) for n, m in model.named_modules()}
    assert all(not isinstance(methods[n], MxLinearMethod) for n in ODD_LAYERS)
    assert any(isinstance(m, MxLinearMethod) for m in methods.values())
    out = forward(vllm_env, ODD_Z_IMAGE, model)
    assert math.isfinite(out.abs().max().item())


def test_refusal_of_an_odd_tensor_parallel_shard_names_the_tp_fix():
    check_quantizable("blocks.0.ffn.net_2", "mxfp4", 1366, 1366, 1)  # even K: held
    check_quantizable("blocks.0.ffn.net_2", "mxfp4", 48, 48, 1)  # not a multiple of 32: padded, held
    with pytest.raises(ValueError, match=r"K=683 \(1366 over tensor-parallel size 2\).*splits K=1366"):
        check_quantizable("blocks.0.ffn.net_2", "mxfp4", 683, 1366, 2)
    with pytest.raises(ValueError) as err:
        check_quantizable("blocks.0.ffn.net_2", "mxfp4_dualscale", 1365, 1365, 1)
    assert "tensor-parallel" not in str(err.value)
