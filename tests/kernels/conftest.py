"""Fixtures that install the semantic fakes of torch_npu / AITER, so the vendor kernels build on them."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.support.fake_aiter import FakeAiter
from tests.support.fake_torch_npu import make_fake_torch_npu

pytest.importorskip("vllm_omni")


@pytest.fixture
def fake_npu(monkeypatch):
    """A fresh fake ``torch_npu`` in ``sys.modules``; removed after the test."""
    fake = make_fake_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


def install_aiter(monkeypatch, rule: str = "rceil", **kwargs) -> FakeAiter:
    """Install a fake AITER of the given scale rule and pretend the GPU is a gfx950."""
    import vllm_omni_mxfp4.kernels.rocm as rocm

    monkeypatch.setattr(rocm, "gpu_arch", lambda: "gfx950:sramecc+:xnack-")
    return FakeAiter(rule, **kwargs).install(monkeypatch)


@pytest.fixture(params=["rceil", "aiter_legacy"])
def fake_aiter(request, monkeypatch):
    """A fake AITER of each scale-rule era (RCEIL since 2026-06, round-half-up before)."""
    return install_aiter(monkeypatch, request.param)


@pytest.fixture
def plain_layer():
    """A bare module holding checkpoint tensors, for driving a kernel without vLLM."""

    def make(ckpt):
        layer = torch.nn.Module()
        for name, t in ckpt.items():
            layer.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
        return layer

    return make
