"""A deliberately bad configuration for the demo's table: W4A4 MXFP4 on *every* Linear of the
transformers, including the ones vLLM-Omni builds as plain ``torch.nn.Linear`` and never hands a
quantization config (Wan2.2's time, timestep-projection and text embedders and its ``proj_out``).

A naive "quantize every Linear" recipe does exactly this; the published MXFP4 recipes and vLLM-Omni
keep those layers in BF16. The demo runs it as one of its modes (next to plain ``mxfp4``, which
quantizes the blocks only), so that the table shows what keeping them buys.

vLLM-Omni has no switch for it, so it is emulated inside the running engine: a vLLM worker extension
(:class:`NaiveW4A4Extension`, which also answers the demo's transformer reports) rounds each plain
Linear's weight to MXFP4 once (OCP ``floor`` scale rule, 32-blocks along K) and rounds its input
the same way on every call, the numerics of the emulated W4A4 backend. The quantized block Linears
are left to the package's real method.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_omni_mxfp4.formats.mx import fake_quantize_mx
from vllm_omni_mxfp4.inspection.engine import TransformerReportExtension

logger = logging.getLogger(__name__)

EXTENSION = "vllm_omni_mxfp4_tiny.naive_w4a4.NaiveW4A4Extension"
"""``worker_extension_cls`` of an ``Omni`` that can run :data:`RPC_METHOD`."""
RPC_METHOD = "mxfp4_naive_w4a4_plain_linears"


def _quantize_input(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (fake_quantize_mx(args[0]), *args[1:])


def quantize_plain_linears(transformer: Any) -> list[str]:
    """Make every plain ``torch.nn.Linear`` of ``transformer`` compute W4A4 MXFP4 (emulated, module
    docstring); returns their names. A Linear whose K is not a multiple of 32 is refused by name."""
    import torch
    from vllm.model_executor.layers.linear import LinearBase

    from vllm_omni_mxfp4.formats.mx import fake_quantize_mx

    plain = {
        name: module
        for name, module in transformer.named_modules()
        if isinstance(module, torch.nn.Linear) and not isinstance(module, LinearBase)
    }
    for name, module in plain.items():  # all checked before any is changed
        if module.in_features % 32:
            raise ValueError(
                f"{name}: in_features {module.in_features} is not a multiple of 32, the MXFP4 block size"
            )
    for module in plain.values():
        with torch.no_grad():
            module.weight.copy_(fake_quantize_mx(module.weight))
        module.register_forward_pre_hook(_quantize_input)
    return list(plain)


class NaiveW4A4Extension(TransformerReportExtension):
    """vLLM worker extension: the demo's transformer reports plus :data:`RPC_METHOD`."""

    def mxfp4_naive_w4a4_plain_linears(self) -> dict[str, list[str]]:
        """Apply :func:`quantize_plain_linears` to each transformer of this rank's pipeline; returns
        the Linears it changed per transformer."""
        pipeline = self.model_runner.pipeline
        changed = {}
        for name, module in pipeline.named_children():
            if name.startswith("transformer") and module is not None:
                changed[name] = quantize_plain_linears(module)
                logger.info("naive W4A4 on the plain Linears of %s: %s", name, ", ".join(changed[name]))
        return changed


def apply(omni: Any, timeout: float = 120.0) -> dict[str, list[str]]:
    """Run :data:`RPC_METHOD` on every worker of ``omni`` (built with ``worker_extension_cls=``
    :data:`EXTENSION`); returns rank 0's answer (every rank changes the same Linears)."""
    results = omni.engine.collective_rpc(RPC_METHOD, timeout=timeout)
    found: list[dict[str, list[str]]] = []

    def collect(value: Any) -> None:
        if isinstance(value, dict):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item)

    collect(results)
    if not found or not any(found[0].values()):
        raise RuntimeError(f"no diffusion worker changed a plain Linear through {RPC_METHOD}")
    return found[0]
