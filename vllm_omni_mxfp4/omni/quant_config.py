"""vLLM ``QuantizationConfig`` wrappers around the pure configs of :mod:`vllm_omni_mxfp4.config`.

Each wrapper names its Linear method class in its definition and owns the
:class:`~vllm_omni_mxfp4.kernels.KernelSelector` of its layers: the config's ``backend`` is resolved
and each kernel built once per config (one model component), and not pickled with it.

They expose the attributes vLLM-Omni's own machinery reads (``ignored_layers``, the W4A8 lists,
``mxfp4_scale_alg``, ``require_smooth_scale``, the ``is_checkpoint_*_serialized`` flags): its
per-expert checkpoint reconciliation (``resolve_quant_config_from_disk``) copies runtime policies
from them, and its Wan2.2 transformer validates ``w4a8_fallback_layers`` against its modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from ..config import Mxfp4Config, Mxfp4DualScaleConfig, Precision, QuantConfig
from ..kernels import KernelSelector
from .linear import CheckedUnquantizedLinearMethod, MxLinearMethod
from .mxfp4 import Mxfp4LinearMethod
from .mxfp4_dualscale import Mxfp4DualScaleLinearMethod
from .mxfp8 import Mxfp8LinearMethod

if TYPE_CHECKING:
    from ..config.methods import RouteOverride


class MxQuantizationConfig(QuantizationConfig):
    """Base of the two vLLM-facing configs; ``self.config`` is the validated pure config."""

    config_class: ClassVar[type]
    method_class: ClassVar[type[MxLinearMethod]]
    #: Route overrides attached where the model is built (:mod:`.routes`), applied in order.
    overrides: tuple[RouteOverride, ...] = ()

    def __init__(self, config: QuantConfig) -> None:
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}"
            )
        self.config = config
        self._kernels: KernelSelector | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_kernels"] = None  # built kernels hold vendor modules; each process selects its own
        return state

    @property
    def kernels(self) -> KernelSelector:
        """The kernels of this config's layers, selected when the first layer asks."""
        if self._kernels is None:
            self._kernels = KernelSelector(self.config.backend)
        return self._kernels

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> MxQuantizationConfig:
        """The builder vLLM-Omni's factory calls with the keys of a dict spec or checkpoint config."""
        return cls(cls.config_class.from_dict(kwargs))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def get_name(self) -> str:
        return self.config.METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # The emulated backend runs on any CUDA GPU; the native paths check their own hardware.
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MxQuantizationConfig:
        return cls(cls.config_class.from_dict(config))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None
        route, config = self.config.route(prefix), self.config
        for override in self.overrides:  # a family's BF16 default, an NVFP4 checkpoint's plan
            route, config = override.override(prefix, route, config)
        if route.precision is Precision.BF16:
            return CheckedUnquantizedLinearMethod(route, config)
        if route.precision is Precision.W8A8:  # a layer the checkpoint stores as MXFP8 (mxfp8_layers)
            return Mxfp8LinearMethod(config, route, prefix, self.kernels)
        return self.method_class(config, route, prefix, self.kernels)

    # Attributes vLLM-Omni reads (lists, as upstream keeps them).
    @property
    def ignored_layers(self) -> list[str]:
        return list(self.config.ignored_layers)

    @property
    def w4a8_fallback_layers(self) -> list[str]:
        return list(getattr(self.config, "w4a8_fallback_layers", ()))

    @property
    def w4a8_fallback_steps(self) -> list[int]:
        return list(getattr(self.config, "w4a8_fallback_steps", ()))

    @property
    def backend(self) -> str:
        return self.config.backend


class Mxfp4QuantizationConfig(MxQuantizationConfig):
    """``mxfp4``: single-scale W4A4 MXFP4 (OCP or UOS), online or offline, W4A8 fallback."""

    config_class = Mxfp4Config
    method_class = Mxfp4LinearMethod

    @property
    def is_checkpoint_mxfp4_serialized(self) -> bool:
        return self.config.is_checkpoint_mxfp4_serialized

    @property
    def mxfp4_scale_alg(self) -> int:
        return self.config.mxfp4_scale_alg

    @property
    def require_smooth_scale(self) -> bool:
        return self.config.require_smooth_scale


class Mxfp4DualScaleQuantizationConfig(MxQuantizationConfig):
    """``mxfp4_dualscale``: per-32 E8M0 + per-512 FP32 scales + Smooth, online or offline."""

    config_class = Mxfp4DualScaleConfig
    method_class = Mxfp4DualScaleLinearMethod

    @property
    def is_checkpoint_serialized(self) -> bool:
        return self.config.is_checkpoint_serialized

    @property
    def num_bf16_fallback_layers(self) -> int:
        return self.config.num_bf16_fallback_layers
