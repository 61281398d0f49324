"""What the running engine actually holds: per transformer, its weight bytes and each Linear's method.

The text-to-video example prints this before it generates, and the demo tabulates it; anyone can
ask a running engine the same way, to check that a checkpoint or config ended up as intended.

vLLM-Omni builds the model inside its diffusion worker(s), which may be other processes. A vLLM
*worker extension* is the engine's own way to run code there: pass
``worker_extension_cls=WORKER_EXTENSION`` to ``Omni(...)`` and :func:`transformer_reports` asks the
workers (every rank) through ``collective_rpc`` for a report of each transformer of their pipeline
(``transformer``, ``transformer_2``):

- its memory (:func:`transformer_memory`): the weights as the model holds them, and the working
  buffers an MXFP4 backend added;
- one entry per vLLM Linear module: the method it runs with (``bf16`` when unquantized), and for
  ``mxfp4`` / ``mxfp4_dualscale`` the backend, online or offline, activation scale rule and W4A8 route;
- for an expert loaded from an NVFP4 checkpoint, the load report of every checkpoint layer
  (:mod:`.nvfp4_loading`: requantized with its rule and error, dequantized to BF16, and why).

Nothing here is estimated from configs: it is read from the live modules after loading.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

WORKER_EXTENSION = "vllm_omni_mxfp4.inspection.engine.TransformerReportExtension"
"""Qualified name to pass as ``Omni(worker_extension_cls=...)``."""

RPC_METHOD = "mxfp4_transformer_report"


def _distinct_bytes(tensors: Any, seen: set[tuple[str, int]]) -> int:
    """Bytes of the storages behind ``tensors`` not already in ``seen`` (shared storage counts once)."""
    total = 0
    for tensor in tensors:
        if tensor is None or tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _kernel_held_bytes(layer: Any) -> int:
    """Bytes of a BF16 weight that vLLM's CPU GEMM moved out of ``layer.weight`` into its kernel.

    On CPU, vLLM's unquantized Linear hands the weight to oneDNN (or a packed SGL kernel) and leaves
    an empty ``weight``. A packed tensor held by the kernel closure is counted exactly; an oneDNN
    handle holds one ``(K, N)`` copy in the parameter dtype, counted as ``K * N * itemsize``.
    """
    import torch

    kernel = getattr(layer, "cpu_linear", None)
    weight = getattr(layer, "weight", None)
    if kernel is None or weight is None or weight.numel() != 0:
        return 0
    total = 0
    for cell in getattr(kernel, "__closure__", None) or ():
        held = cell.cell_contents
        if isinstance(held, torch.Tensor):
            total += held.untyped_storage().nbytes()
        elif hasattr(held, "handler_tensor") and hasattr(held, "n") and hasattr(held, "k"):
            itemsize = torch.empty((), dtype=getattr(layer, "params_dtype", torch.bfloat16)).element_size()
            total += int(held.n) * int(held.k) * itemsize
    return total


def transformer_memory(module: Any) -> dict[str, int]:
    """The weight bytes one transformer module holds, from its live tensors.

    - ``weight_bytes``: the model's weights in the format it holds them: every tensor of its
      ``state_dict`` (parameters and persistent buffers: packed FP4 weights, scales, Smooth vectors,
      BF16 layers, norms, biases), plus BF16 Linear weights held by vLLM's CPU GEMM kernels
      (``kernel_bytes``, included in ``weight_bytes``);
    - ``backend_bytes``: working buffers an MXFP4 kernel added (non-persistent buffers of each
      layer's ``_mx_prepared`` module, e.g. the emulated kernels' cache of dequantized weights, the
      NPU/ROCm kernel layouts).
    """
    seen: set[tuple[str, int]] = set()
    state = _distinct_bytes(module.state_dict(keep_vars=True).values(), seen)
    kernel = sum(_kernel_held_bytes(sub) for sub in module.modules())
    backend = _distinct_bytes(
        (buf for name, buf in module.named_buffers() if any(p.startswith("_mx") for p in name.split("."))),
        seen,
    )
    return {"weight_bytes": state + kernel, "kernel_bytes": kernel, "backend_bytes": backend}


def _linear_entry(name: str, module: Any) -> dict[str, Any]:
    """How one vLLM Linear runs: its quant method's name and, for ours, its backend and route."""
    method = getattr(module, "quant_method", None)
    entry: dict[str, Any] = {"layer": name}
    method_name = getattr(method, "method_name", None)
    if method_name:  # vllm_omni_mxfp4.omni.linear.MxLinearMethod
        route = method.route
        entry.update(
            method=method_name,
            backend=method.backend,
            mode="online" if method.online else "offline",
            act_scale_rule=method.act_scale_rule,
            precision=route.precision.value,
            w4a8_steps=list(route.a8_steps),
            low_rank=module._mx.low_rank,  # the rank of its low-rank branch (svd_rank or a stored pair); 0: none
        )
    elif method is None or type(method).__name__ in (
        "UnquantizedLinearMethod",
        "CheckedUnquantizedLinearMethod",
    ):
        entry.update(method="bf16")
    else:
        entry.update(method=type(method).__name__)
    return entry


class TransformerReportExtension:
    """vLLM worker extension (mixed into the diffusion worker) answering :data:`RPC_METHOD`."""

    def mxfp4_transformer_report(self) -> dict[str, Any]:
        """Per transformer of every rank's pipeline: memory and Linear entries.

        vLLM-Omni runs a control RPC on every rank but returns rank 0's answer only, so the ranks
        gather their reports to each other over the world group's CPU (gloo) group first.
        """
        import torch
        from vllm.model_executor.layers.linear import LinearBase

        from ..hooks.nvfp4_loading import PLAN_ATTR

        pipeline = self.model_runner.pipeline
        transformers = {}
        for name, module in pipeline.named_children():
            if not name.startswith("transformer") or module is None:
                continue
            transformers[name] = {
                **transformer_memory(module),
                "linears": [
                    _linear_entry(layer, sub)
                    for layer, sub in module.named_modules()
                    if isinstance(sub, LinearBase)
                ],
                "nvfp4": list(getattr(getattr(module, PLAN_ATTR, None), "records", [])),
            }
        local = {"rank": int(getattr(self, "rank", 0)), "transformers": transformers}
        world = world_group()
        if world is None or world.world_size == 1:
            return {"ranks": [local]}
        gathered: list[Any] = [None] * world.world_size
        torch.distributed.all_gather_object(gathered, local, group=world.cpu_group)
        return {"ranks": gathered}


def world_group() -> Any:
    """vLLM-Omni's diffusion world group, or None when no distributed environment is up."""
    from vllm_omni.diffusion.distributed import parallel_state

    try:
        return parallel_state.get_world_group()
    except AssertionError:
        return None


@dataclass
class LoadedTransformer:
    """One transformer of the running engine; byte counts are summed over all ranks (``ranks``)."""

    name: str
    weight_bytes: int
    kernel_bytes: int
    backend_bytes: int
    linears: list[dict[str, Any]] = field(default_factory=list)
    ranks: int = 1
    nvfp4: list[dict[str, Any]] = field(default_factory=list)
    """An NVFP4 checkpoint's load report, one record per checkpoint layer (empty for other checkpoints)."""

    def methods(self) -> Counter:
        """Number of Linear modules per (method, backend, mode, A4 scale rule, precision)."""
        keys = ("method", "backend", "mode", "act_scale_rule", "precision")
        return Counter(tuple(entry.get(k) for k in keys) for entry in self.linears)

    def summary(self) -> str:
        """One readable line, e.g. ``16 Linears: 16 mxfp4 online W4A4 [backend emulated, A4 scale OCP]``."""
        parts = []
        for (method, backend, mode, rule, precision), count in sorted(
            self.methods().items(), key=lambda kv: (-kv[1], str(kv[0]))
        ):
            if method == "bf16" or backend is None:
                parts.append(f"{count} {method.upper() if method == 'bf16' else method}")
                continue
            steps = sorted({s for e in self.linears if e.get("method") == method for s in e["w4a8_steps"]})
            prec = precision.upper() + (f" (W4A8 on steps {steps})" if steps and precision == "w4a4" else "")
            scale = {"floor": "OCP", "uos": "UOS"}.get(rule, rule)
            parts.append(f"{count} {method} {mode} {prec} [backend {backend}, A4 scale {scale}]")
        text = f"{len(self.linears)} Linears: " + "; ".join(parts)
        if self.nvfp4:
            actions = Counter(r["action"] for r in self.nvfp4)
            rules = sorted({r["rule"] for r in self.nvfp4 if "rule" in r})
            text += (
                f"; NVFP4 checkpoint: {actions['requantize']} layers requantized (rule {', '.join(rules)})"
            )
            text += f", {actions['dequantize']} dequantized to BF16, {actions['keep']} kept as stored"
        return text


def platform_description() -> str:
    """vLLM-Omni's current platform in words, e.g. ``CpuOmniPlatform (device cpu): ...``."""
    from vllm_omni.platforms import current_omni_platform

    name = type(current_omni_platform).__name__
    text = f"{name} (device {current_omni_platform.device_type})"
    if name == "CpuOmniPlatform":
        text += ": vllm-omni-mxfp4's CPU platform, no accelerator (emulation, not a performance path)"
    return text


def _rank_reports(results: Any) -> list[dict[str, Any]]:
    """Flatten ``collective_rpc`` results (per stage, per replica, per rank) into rank reports."""
    found: list[dict[str, Any]] = []
    stack = [results]
    while stack:
        item = stack.pop()
        if isinstance(item, dict) and "ranks" in item:
            stack.extend(item["ranks"])
        elif isinstance(item, dict) and "transformers" in item:
            found.append(item)
        elif isinstance(item, dict) and item.get("supported") is False:
            raise RuntimeError(
                f"the engine could not run {RPC_METHOD}: {item.get('error')} (was Omni built with "
                f"worker_extension_cls={WORKER_EXTENSION!r}?)"
            )
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    by_rank = {r["rank"]: r for r in found}  # several replies may carry the same gathered ranks
    return [by_rank[rank] for rank in sorted(by_rank)]


def transformer_reports(omni: Any, timeout: float = 120.0) -> list[LoadedTransformer]:
    """Ask the workers of an ``Omni`` built with ``worker_extension_cls=WORKER_EXTENSION``.

    Byte counts are summed over all ranks (tensor-parallel shards, and replicas under sequence or
    CFG parallelism); Linear entries are rank 0's (every rank has the same modules and methods).
    """
    engine = getattr(omni, "engine", None)
    if engine is None or not hasattr(engine, "collective_rpc"):
        raise RuntimeError(f"{type(omni).__name__} has no engine.collective_rpc; pass a vllm_omni.Omni")
    ranks = _rank_reports(engine.collective_rpc(RPC_METHOD, timeout=timeout))
    if not ranks:
        raise RuntimeError(f"no diffusion worker answered {RPC_METHOD}")
    reports: dict[str, LoadedTransformer] = {}
    for rank in ranks:
        for name, info in rank["transformers"].items():
            report = reports.get(name)
            if report is None:
                reports[name] = LoadedTransformer(
                    name, info["weight_bytes"], info["kernel_bytes"], info["backend_bytes"], info["linears"],
                    nvfp4=info.get("nvfp4", []),
                )  # fmt: skip
            else:
                report.weight_bytes += info["weight_bytes"]
                report.kernel_bytes += info["kernel_bytes"]
                report.backend_bytes += info["backend_bytes"]
                report.ranks += 1
    return [reports[name] for name in sorted(reports)]
