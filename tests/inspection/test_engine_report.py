"""The engine report (a vLLM worker extension): live tensor bytes, per-Linear methods, rank gathering.

The text-to-video example and the demo print these reports; here they are checked without an
engine, against modules and ``collective_rpc`` replies built by hand.
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni_mxfp4.inspection import engine as engine_report


class _Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 32).to(torch.bfloat16)
        self.tied = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)
        self.tied.weight = self.proj.weight  # one storage, counted once
        self.proj.register_buffer("_mx_weight_dequant", torch.zeros(32, 64), persistent=False)
        self.register_buffer("freqs", torch.zeros(1000), persistent=False)  # model buffer, not a weight
        self.moved = torch.nn.Module()
        self.moved.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        packed = torch.zeros(16, 8, dtype=torch.float32)  # what a CPU GEMM kernel kept
        self.moved.cpu_linear = lambda x, weight, bias: packed


def test_transformer_memory_counts_live_tensors():
    memory = engine_report.transformer_memory(_Expert())
    assert memory["kernel_bytes"] == 16 * 8 * 4
    assert memory["weight_bytes"] == (32 * 64 + 32) * 2 + 16 * 8 * 4
    assert memory["backend_bytes"] == 32 * 64 * 4


def _rank(rank: int, weight: int) -> dict:
    linears = [
        {"layer": "blocks.0.attn1.to_qkv", "method": "bf16"},
        {"layer": "blocks.1.attn1.to_qkv", "method": "mxfp4", "backend": "emulated", "mode": "online"}
        | {"act_scale_rule": "uos", "precision": "w4a4", "w4a8_steps": [0, 3]},
        {"layer": "blocks.1.ffn.net_2", "method": "mxfp4", "backend": "emulated", "mode": "online"}
        | {"act_scale_rule": "uos", "precision": "w4a4", "w4a8_steps": [0, 3]},
    ]
    info = {"weight_bytes": weight, "kernel_bytes": 1, "backend_bytes": 2, "linears": linears}
    return {"rank": rank, "transformers": {"transformer": info}}


class _Engine:
    def __init__(self, results):
        self.results = results

    def collective_rpc(self, method, timeout=None):
        assert method == engine_report.RPC_METHOD
        return self.results


class _Omni:
    def __init__(self, results):
        self.engine = _Engine(results)


def test_reports_sum_ranks_and_summarize():
    (report,) = engine_report.transformer_reports(_Omni([[_rank(1, 30), _rank(0, 70)]]))
    assert (report.name, report.weight_bytes, report.kernel_bytes, report.backend_bytes, report.ranks) == (
        "transformer",
        100,
        2,
        4,
        2,
    )
    assert report.summary() == (
        "3 Linears: 2 mxfp4 online W4A4 (W4A8 on steps [0, 3]) [backend emulated, A4 scale UOS]; 1 BF16"
    )


def test_reports_fail_clearly():
    with pytest.raises(
        RuntimeError, match="could not run mxfp4_transformer_report: no such method.*worker_extension_cls"
    ):
        engine_report.transformer_reports(_Omni([{"supported": False, "error": "no such method"}]))
    with pytest.raises(RuntimeError, match="no engine.collective_rpc"):
        engine_report.transformer_reports(object())
    with pytest.raises(RuntimeError, match="no diffusion worker answered"):
        engine_report.transformer_reports(_Omni([[]]))


def test_gathered_ranks_are_counted_once():
    """vLLM-Omni returns rank 0's reply, which carries every rank's report (gathered over the world group)."""
    gathered = {"ranks": [_rank(0, 70), _rank(1, 30)]}
    (report,) = engine_report.transformer_reports(_Omni([[gathered, gathered]]))
    assert (report.weight_bytes, report.ranks) == (100, 2)
