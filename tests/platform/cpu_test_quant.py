"""A test-only quantization method registered under ``mxfp4`` exactly as a real vLLM-Omni plugin would be.

Weight-only symmetric int8 with one scale per output channel: enough to prove that a quantization
config reaches every quantizable Linear through the CPU platform's engine path (config built in
the orchestrator, pickled to workers, ``create_weights`` / ``process_weights_after_loading`` /
``apply`` called on the right layers). The project's real ``mxfp4`` methods come from
``vllm_omni_mxfp4.omni``; the engine test excludes that plugin with ``VLLM_PLUGINS``.

It takes the name ``mxfp4`` because vLLM-Omni 0.30's ``Omni(...)`` validates the method name
against its registry *before* it loads general plugins, so a plugin can only override a name the
registry already knows (``mxfp4`` is one); that is also how the project's own plugin works, and
``Omni(model=..., quantization="mxfp4")`` is the user's call.

:func:`register` is a ``vllm_omni.general_plugins`` entry point (the ``cpu_test_quant_site``
fixture installs a dist-info for it). When ``CPU_TEST_QUANT_RECORD`` names a file, every
processed layer appends ``<pid> <prefix> <rows>x<cols>`` to it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.utils import set_weight_attrs

METHOD = "mxfp4"
RECORD_ENV = "CPU_TEST_QUANT_RECORD"


class CpuTestInt8LinearMethod(LinearMethodBase):
    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        weight = torch.nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        set_weight_attrs(weight, extra_weight_attrs)
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight = layer.weight.data.float()
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
        codes = torch.round(weight / scale).clamp(-127, 127).to(torch.int8)
        layer.weight = torch.nn.Parameter(codes, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        record = os.environ.get(RECORD_ENV)
        if record:
            with open(record, "a") as out:
                out.write(f"{os.getpid()} {layer.prefix} {codes.shape[0]}x{codes.shape[1]}\n")

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight = (layer.weight.float() * layer.weight_scale).to(x.dtype)
        return F.linear(x, weight, bias)


class CpuTestInt8Config(QuantizationConfig):
    def get_name(self) -> str:
        return METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CpuTestInt8Config:
        return cls()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> LinearMethodBase | None:
        if isinstance(layer, LinearBase):
            return CpuTestInt8LinearMethod()
        return None


def build(**kwargs: Any) -> CpuTestInt8Config:
    if kwargs:
        raise ValueError(f"{METHOD} takes no options, got {sorted(kwargs)}")
    return CpuTestInt8Config()


def register() -> None:
    from vllm_omni.quantization.factory import register_quantization_override

    register_quantization_override(METHOD, build)
