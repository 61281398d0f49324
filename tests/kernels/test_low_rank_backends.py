"""The online low-rank branch (``svd_rank``) on every kernel: the NPU and ROCm kernels on their fakes.

The branch runs outside the kernel, so on each backend a layer with ``svd_rank`` must give exactly
what the same backend gives for the residual alone, plus the pair's product, and must quantize the
same residual as the emulated kernel that mirrors it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.compare import both
from tests.support.layers import activations, build, outlier_weight, run
from vllm_omni_mxfp4.formats import split_weight

from .conftest import install_aiter

pytestmark = pytest.mark.omni

SPECS = {
    "mxfp4": {"method": "mxfp4", "svd_rank": 8},
    "mxfp4_dualscale": {"method": "mxfp4_dualscale", "svd_rank": 8, "num_bf16_fallback_layers": 0},
    "mxfp4 w4a8": {"method": "mxfp4", "svd_rank": 8, "w4a8_fallback_layers": ["blocks.1.attn2.to_q"]},
}


def _check_branch_on(env, backend, spec, *, mirror="npu", k=1024, dtype=torch.bfloat16):
    w, x = outlier_weight(60, k=k), activations(61, k=k).to(dtype)
    vendor, emulated = both(env, spec, {"weight": w}, backend, mirror=mirror, k=k, dtype=dtype)
    l1, l2, residual = split_weight(w, spec["svd_rank"])
    plain = build(env, {**spec, "svd_rank": 0, "backend": backend}, {"weight": residual}, k=k, dtype=dtype)
    branch = F.linear(F.linear(x, l1.to(dtype)), l2.to(dtype))
    out = run(env, vendor, x)
    assert torch.equal(out, run(env, plain, x) + branch)
    assert torch.equal(out, run(env, emulated, x))
    assert torch.equal(vendor.svd_lowrank_l1, emulated.svd_lowrank_l1)
    assert torch.equal(vendor.state_dict()["weight"], emulated.state_dict()["weight"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("spec", list(SPECS), ids=str)
def test_npu_kernels_keep_the_branch(vllm_env, fake_npu, spec, dtype):
    _check_branch_on(vllm_env, "npu", SPECS[spec], dtype=dtype)


@pytest.mark.parametrize("rule", ["rceil", "aiter_legacy"])
def test_rocm_kernel_keeps_the_branch(vllm_env, monkeypatch, rule):
    fake = install_aiter(monkeypatch, rule)
    _check_branch_on(vllm_env, "rocm", SPECS["mxfp4"], mirror=f"rocm:{fake.rule}")
