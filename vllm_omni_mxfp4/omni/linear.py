"""The MXFP4 Linear method: a quantized Linear's lifecycle, its forward and the custom op.

Life of a quantized Linear (its state: :class:`~.state.MxLayerState` at ``layer._mx``):

- ``create_weights`` (phase ``CREATED``): the kernel is chosen for the layer
  (:class:`~vllm_omni_mxfp4.kernels.KernelSelector`; what it cannot run is refused here, before
  any allocation); online, a BF16 ``weight`` on the meta device (no memory); offline, the format's
  checkpoint tensors as :mod:`vllm_omni_mxfp4.spec` lists them. Every parameter gets a loader
  wrapper (:mod:`.loading`).
- Loading (``LOADING``): online, the moment the last element of the weight arrives the kernel
  quantizes it and the BF16 weight is freed (``QUANTIZED``), so loading never holds more than one
  BF16 layer above the quantized model; the layer is prepared at once.
- ``process_weights_after_loading``: offline, checks completeness, NaN scales and Smooth
  (``LOADED``); then the kernel prepares its tensors (``PREPARED``). Idempotent; vLLM-Omni's loader
  skips layers whose ``_already_called_process_weights_after_loading`` is set.
- ``apply``: the precision (A4, or A8 on W4A8 routes/steps) is decided per call from the step
  provider, with no state on the layer; then the kernel runs. Under ``torch.compile`` the whole call
  is one opaque custom op, so a new denoising step never triggers a recompilation.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any, ClassVar

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.linear import LinearMethodBase, RowParallelLinear, UnquantizedLinearMethod
from vllm.model_executor.utils import set_weight_attrs

from .. import envs
from ..config import LayerRoute, Precision, QuantConfig
from ..kernels import KernelSelector, MxKernel, MxLayerSpec
from ..spec import BIAS, FORMATS, VALUE_RULES, CheckpointTensor, checkpoint_tensors
from . import low_rank, trace
from .loading import check_values, checked_tensor, counted_load, row_shard, shard_geometry, shared_blocks
from .shapes import check_quantizable
from .state import PREPARED_ATTR, MxLayerState, Phase

logger = logging.getLogger(__name__)

# Layers reachable from the custom op by an integer handle (weak: a dropped model is collected, and
# its entry removed with it).
_LAYERS: dict[int, weakref.ref] = {}
_HANDLES = itertools.count(1)


def register_layer(layer: torch.nn.Module) -> int:
    """A handle for ``layer`` that the custom op resolves; forgotten when the layer is collected."""
    handle = next(_HANDLES)
    _LAYERS[handle] = weakref.ref(layer)
    weakref.finalize(layer, _LAYERS.pop, handle, None)
    return handle


def _layer_for(handle: int) -> torch.nn.Module:
    ref = _LAYERS.get(handle)
    layer = None if ref is None else ref()
    if layer is None:
        raise RuntimeError(f"vllm_omni_mxfp4: quantized layer #{handle} no longer exists")
    return layer


@torch.library.custom_op("vllm_omni_mxfp4::linear", mutates_args=())
def _linear_op(x: torch.Tensor, bias: torch.Tensor | None, handle: int) -> torch.Tensor:
    layer = _layer_for(handle)
    return layer.quant_method.forward(layer, x, bias)


@_linear_op.register_fake
def _linear_op_fake(x: torch.Tensor, bias: torch.Tensor | None, handle: int) -> torch.Tensor:
    out_features = _layer_for(handle).output_size_per_partition
    return x.new_empty((*x.shape[:-1], out_features))


class MxLinearMethod(LinearMethodBase):
    """One quantized Linear of format :attr:`method_name`; subclasses add the format's config facts.

    ``kernels`` is the owning quantization config's :class:`KernelSelector` (a fresh one for the
    config's ``backend`` when the method is built alone).
    """

    method_name: ClassVar[str] = ""
    #: Middle of the config's serialized flag, named in errors: ``is_checkpoint_<infix>serialized``.
    serialized_infix: ClassVar[str] = ""
    #: The error for a tensor of another format (``{where}``: prefix.name), or None to ignore it.
    foreign_tensor_error: ClassVar[str | None] = None
    #: The weight is packed FP4 (two inputs a byte), which needs an even K per partition.
    packed_fp4: ClassVar[bool] = True

    def __init__(
        self, config: QuantConfig, route: LayerRoute, prefix: str, kernels: KernelSelector | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.route = route
        self.prefix = prefix
        self.kernels = kernels if kernels is not None else KernelSelector(config.backend)
        self.online = not config.is_serialized
        # Read by vLLM-Omni's Wan post-load summary.
        self.is_w4a8_fallback_layer = route.precision is Precision.W4A8

    # ------------------------------------------------------------------ format facts (subclasses)

    @property
    def act_scale_rule(self) -> str:
        """Scale rule of online weights and A4 activations."""
        return "floor"

    @property
    def backend(self) -> str:
        """The backend this config's layers run on (``auto`` resolved)."""
        return self.kernels.backend

    def checkpoint_tensors(self) -> tuple[CheckpointTensor, ...]:
        """The quantized tensors of an offline checkpoint (the table's, without ``bias``: vLLM owns it)."""
        return tuple(t for t in checkpoint_tensors(self.method_name) if t.name != "bias")

    def tensor(self, name: str) -> CheckpointTensor:
        return next(t for t in self.checkpoint_tensors() if t.name == name)

    # ------------------------------------------------------------------ CREATED

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
        """Choose the kernel, then register a lazy BF16 weight (online) or the checkpoint tensors."""
        vllm_loader = extra_weight_attrs.pop("weight_loader")
        n, k = sum(output_partition_sizes), input_size_per_partition
        if self.packed_fp4:
            check_quantizable(self.prefix, self.method_name, k, input_size, getattr(layer, "tp_size", 1))
        layer._mx = self._new_state(layer, n, k, input_size)
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = k
        layer.output_size_per_partition = n
        layer.orig_dtype = params_dtype
        if self.online:
            weight = torch.empty(n, layer._mx.geometry.k_padded, dtype=params_dtype, device="meta")
            self._register(layer, "weight", weight, {"input_dim": 1, "output_dim": 0}, vllm_loader)
            if self.config.svd_rank:
                low_rank.create(layer, self.prefix, self.method_name, self.config.svd_rank, output_size)
            return
        for tensor in self.checkpoint_tensors():
            self._register_checkpoint_tensor(layer, tensor, n, vllm_loader)
        rank = self.config.svd_lowrank_layers.get(self.prefix, 0)
        if rank:  # a stored low-rank pair (msModelSlim svd_res, merged)
            low_rank.create(
                layer, self.prefix, self.method_name, rank, output_size, stored=True, vllm_loader=vllm_loader
            )
        self._register_foreign_sentinels(layer)

    def _new_state(self, layer: torch.nn.Module, n: int, k: int, k_full: int) -> MxLayerState:
        """The layer's state: shard geometry, kernel spec, the chosen kernel, a custom-op handle."""
        sharded = isinstance(layer, RowParallelLinear) and layer.tp_size > 1
        block = max(t.k_per_index for t in self.checkpoint_tensors())
        geometry = shard_geometry(
            self.prefix,
            k,
            k_full,
            tp_rank=layer.tp_rank if sharded else 0,
            tp_size=layer.tp_size if sharded else 1,
            block=block,
        )
        spec = MxLayerSpec(
            prefix=self.prefix,
            fmt=self.method_name,
            scale_rule=self.act_scale_rule,
            in_features=k,
            out_features=n,
            w4a8=self.route.precision is Precision.W4A8 or bool(self.route.a8_steps),
            k_pad_front=geometry.front,
            k_pad_back=geometry.back,
            shared=shared_blocks(
                self.prefix, geometry, layer.tp_rank if sharded else 0, layer.tp_size, block
            ),
        )
        kernel = self.kernels.kernel_for(spec)  # refuses what the kernel cannot run, before allocation
        device = torch.get_default_device()
        state = MxLayerState(spec, geometry, kernel, register_layer(layer), self.online)
        state.load_device = torch.device("cpu") if device.type == "meta" else device
        return state

    def _register_checkpoint_tensor(
        self, layer: torch.nn.Module, tensor: CheckpointTensor, n: int, vllm_loader
    ) -> None:
        dtype = {"U8": torch.uint8, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}[tensor.dtypes[0]]
        shape = tensor.shape(n, layer._mx.geometry.k_of(tensor))
        if tensor.k_axis == 0:  # the Smooth vector: NaN until loaded, so a partial load shows
            data = torch.full(shape, float("nan"), dtype=dtype)
            attrs = {"input_dim": 0, "ignore_warning": True, "is_checkpoint_optional": not tensor.required}
        else:
            data = torch.empty(shape, dtype=dtype)
            attrs = {"input_dim": 1, "output_dim": 0}
        attrs["is_checkpoint_required"] = tensor.required
        self._register(layer, tensor.name, data, attrs, vllm_loader)

    def _register_foreign_sentinels(self, layer: torch.nn.Module) -> None:
        """Placeholders for other formats' tensors, whose only job is to refuse them with a clear
        message; removed after loading."""
        if self.foreign_tensor_error is None:
            return
        own = {t.name for t in checkpoint_tensors(self.method_name)}
        others = {t.name for fmt in FORMATS for t in checkpoint_tensors(fmt)} - own
        for name in sorted(others):
            sentinel = Parameter(torch.empty(0), requires_grad=False)
            layer.register_parameter(name, sentinel)
            message = self.foreign_tensor_error.format(where=f"{self.prefix}.{name}")

            def refuse(param, loaded_weight, *args, _message=message) -> None:
                raise ValueError(_message)

            set_weight_attrs(
                sentinel, {"is_checkpoint_optional": True, "ignore_warning": True, "weight_loader": refuse}
            )

    def _register(
        self, layer: torch.nn.Module, name: str, data: torch.Tensor, attrs: dict, vllm_loader
    ) -> None:
        param = Parameter(data, requires_grad=False)
        layer.register_parameter(name, param)
        set_weight_attrs(param, {**attrs, "weight_loader": self._loader(layer, name, vllm_loader)})

    # ------------------------------------------------------------------ LOADING

    def _loader(self, layer: torch.nn.Module, name: str, vllm_loader):
        """A weight loader for parameter ``name`` that checks, converts, shards and counts."""
        state: MxLayerState = layer._mx

        def load(param: Parameter, loaded_weight: torch.Tensor, *args: Any) -> None:
            loaded_weight = self._checked(state, name, loaded_weight, *args)
            if state.low_rank and self.online:  # svd_rank: the pair from the whole piece, the residual loads
                loaded_weight = low_rank.split_on_load(layer, self.prefix, loaded_weight, args, vllm_loader)
            if name == "mul_scale" and state.loaded_count(name):
                self._check_shared_smooth(layer, loaded_weight)
            tensor = None if self.online else self.tensor(name)

            def copy(target: torch.Tensor) -> None:
                try:
                    if state.geometry.sharded:
                        target.data.copy_(row_shard(state.geometry, tensor, loaded_weight))
                    else:
                        vllm_loader(target, loaded_weight, *args)
                except (AssertionError, RuntimeError) as exc:
                    raise ValueError(
                        f"{self.prefix}.{name}: checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit "
                        f"the parameter of shape {tuple(target.shape)} (layer {type(layer).__name__}): {exc}"
                    ) from exc

            loaded = counted_load(state, layer, name, copy)
            if self.online and loaded >= layer.weight.numel():
                self._quantize_online(layer)

        return load

    def _check_shared_smooth(self, layer: torch.nn.Module, smooth: torch.Tensor) -> None:
        """Fused Q/K/V: one Smooth tensor per projection, and all three must agree."""
        have = layer.mul_scale.data
        if not torch.equal(have.to(smooth.dtype), smooth.to(have.device)):
            raise ValueError(f"Fused Q/K/V must share the same Smooth tensor: {self.prefix}.mul_scale")

    def where(self, name: str, *shard: Any) -> str:
        """``prefix.name`` of a checkpoint tensor for messages, with the fused piece (``'q'``) it is."""
        where = f"{self.prefix}.{name}"
        if shard and isinstance(shard[0], str):
            where += f" (fused piece {shard[0]!r})"
        return where

    def _checked(self, state: MxLayerState, name: str, t: torch.Tensor, *shard: Any) -> torch.Tensor:
        """Validate a checkpoint tensor against the format; returns it in the parameter's layout."""
        where, k_full = self.where(name, *shard), state.geometry.k_full
        if not self.online:
            return checked_tensor(where, self.tensor(name), t, k_full)
        if name != "weight":
            raise ValueError(
                f"{where}: online {self.method_name} loads only BF16 weights, got '{name}' ({t.dtype} "
                f"{tuple(t.shape)}), a tensor of a pre-quantized checkpoint; declare "
                f"is_checkpoint_{self.serialized_infix}serialized: true in the quantization_config of the "
                "transformer's config.json and omit the quantization argument"
            )
        if t.dtype == torch.uint8 or t.shape[-1] != k_full:
            raise ValueError(
                f"{where}: online {self.method_name} expects a BF16/FP16/FP32 weight (N, {k_full}), got "
                f"{t.dtype} {tuple(t.shape)}; for a pre-quantized checkpoint declare "
                f"is_checkpoint_{self.serialized_infix}serialized: true in the quantization_config of the "
                "transformer's config.json (the config says online: the flag is false or absent, or the "
                "config is not an object) and omit the quantization argument"
            )
        check_values(where, VALUE_RULES["finite"], t)  # a NaN/Inf weight would quantize to NaN scales
        return t

    def _quantize_online(self, layer: torch.nn.Module) -> None:
        """QUANTIZED: quantize the completely loaded BF16 weight into the checkpoint tensors, drop it,
        and prepare the layer."""
        state: MxLayerState = layer._mx
        tensors = state.kernel.quantize_weight(layer.weight.data, state.spec)
        front, k = state.geometry.front, state.geometry.k
        if envs.keep_bf16():  # for tune: the partition's own K, without the block-alignment padding
            state.bf16_weight = layer.weight.data[:, front : front + k].to("cpu", copy=True)
        if front or state.geometry.back:
            tensors["weight"] = tensors["weight"][:, front // 2 : (front + k) // 2].contiguous()
        for name, value in tensors.items():
            layer.register_parameter(name, Parameter(value, requires_grad=False))
            set_weight_attrs(getattr(layer, name), {"input_dim": 1, "output_dim": 0})
        state.phase = Phase.QUANTIZED
        self._prepare(layer, smooth=None)

    # ------------------------------------------------------------------ LOADED -> PREPARED

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check that every required tensor arrived, validate Smooth, let the kernel prepare."""
        state: MxLayerState = layer._mx
        if state.phase is Phase.PREPARED:
            return
        if self.online:
            raise ValueError(
                f"{self.prefix}.weight: online {self.method_name} needs the complete BF16 weight, but "
                f"{state.loaded_count('weight')} of {layer.weight.numel()} elements were loaded"
            )
        self._check_complete(layer, state)
        if getattr(layer, "bias", None) is not None:
            check_values(f"{self.prefix}.bias", BIAS.value_rule, layer.bias.data)
        smooth = self._validated_smooth(layer) if state.loaded_count("mul_scale") else None
        for name, param in list(layer.named_parameters(recurse=False)):
            if (
                name != "bias"
                and getattr(param, "is_checkpoint_optional", False)
                and not state.loaded_count(name)
            ):
                del layer._parameters[name]  # an absent optional Smooth, or another format's sentinel
        state.phase = Phase.LOADED
        self._prepare(layer, smooth)

    def _check_complete(self, layer: torch.nn.Module, state: MxLayerState) -> None:
        for name, param in layer.named_parameters(recurse=False):
            required_by = getattr(param, "required_by", None)  # optional to vLLM, required here
            if name == "bias" or (getattr(param, "is_checkpoint_optional", False) and required_by is None):
                continue
            if state.loaded_count(name) < param.numel():
                raise ValueError(
                    f"{self.prefix}.{name}: required by offline {self.method_name}"
                    f"{f' ({required_by})' if required_by else ''} but "
                    f"{'missing from' if not state.loaded_count(name) else 'incomplete in'} the checkpoint"
                )

    def _validated_smooth(self, layer: torch.nn.Module) -> torch.Tensor | None:
        """The Smooth multiplier in the activation dtype, or None when it is all ones."""
        smooth = layer.mul_scale.data
        cast = smooth.to(layer.orig_dtype)
        check_values(
            f"{self.prefix}.mul_scale",
            VALUE_RULES["smooth_in_activation_dtype"],
            cast,
            note=f" once converted to the activation dtype {layer.orig_dtype}",
            original=smooth,
        )
        if bool((cast == 1).all()):
            return None
        return cast

    def _prepare(self, layer: torch.nn.Module, smooth: torch.Tensor | None) -> None:
        """PREPARED: the kernel's tensors become the layer's child ``_mx_prepared``."""
        state: MxLayerState = layer._mx
        setattr(layer, PREPARED_ATTR, state.kernel.prepare(layer, state.spec, smooth))
        state.phase = Phase.PREPARED
        layer._already_called_process_weights_after_loading = True  # vLLM-Omni's loader skips the layer

    def use_kernel(self, layer: torch.nn.Module, kernel: MxKernel) -> None:
        """Run a prepared layer on another kernel of its format (e.g. to compare a vendor kernel with
        the emulated one on the same loaded model): the checkpoint tensors are prepared again."""
        state: MxLayerState = layer._mx
        if state.phase is not Phase.PREPARED:
            raise RuntimeError(
                f"{self.prefix}: use_kernel() needs a prepared layer (phase {state.phase.value})"
            )
        kernel.check(state.spec)
        old = getattr(layer, PREPARED_ATTR)
        old.release(layer)
        state.kernel = kernel
        setattr(layer, PREPARED_ATTR, kernel.prepare(layer, state.spec, old.smooth))

    # ------------------------------------------------------------------ forward

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ W^T + bias`` with MXFP4 weights and MXFP4/MXFP8 activations."""
        if torch.compiler.is_compiling():
            return torch.ops.vllm_omni_mxfp4.linear(x, bias, layer._mx.handle)
        return self.forward(layer, x, bias)

    def forward(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        precision: Precision | None = None,
    ) -> torch.Tensor:
        """The eager forward (also the body of the custom op); ``precision``, when given, replaces the
        route's decision (``vllm-omni-mxfp4 tune`` runs a layer at either precision)."""
        state: MxLayerState = layer._mx
        if state.phase is not Phase.PREPARED:
            raise RuntimeError(
                f"{self.prefix}: process_weights_after_loading() has not run; load the model through "
                "vLLM-Omni's loader or call it on every quantized layer after load_weights()"
            )
        precision = precision or self.route.precision_now()
        trace.record(layer, self.method_name, self.prefix, precision, state.kernel.backend)
        prepared = getattr(layer, PREPARED_ATTR)
        x2d = x.reshape(-1, x.shape[-1])
        out = state.kernel.apply(layer, prepared, x2d, bias, precision)
        if state.low_rank:
            out = low_rank.apply(layer, x2d, out)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class CheckedUnquantizedLinearMethod(UnquantizedLinearMethod):
    """vLLM's BF16 Linear method for a layer our config keeps unquantized, with load-time checks.

    The weight loader refuses a packed (uint8) or otherwise non-float weight with a message naming
    the layer and why the config keeps it in BF16 (typically an ``ignored_layers`` entry that names
    a quantized layer of the checkpoint); ``process_weights_after_loading`` checks that weight and
    bias are finite (one vectorised pass each) before vLLM's own processing.
    """

    def __init__(self, route: LayerRoute, config: QuantConfig) -> None:
        super().__init__()
        self.route = route
        self.config = config  # no ``method_name`` attribute: that marks an MxLinearMethod

    def create_weights(self, layer: torch.nn.Module, *args: Any, **extra_weight_attrs: Any) -> None:
        vllm_loader = extra_weight_attrs.pop("weight_loader")
        prefix, why, method = self.route.prefix, self.route.reason, self.config.METHOD

        if self.config.is_serialized:
            fix = (
                f"Remove {prefix!r} from ignored_layers in the transformer's config.json (the merge CLI writes "
                "that list from the export), or load a checkpoint that has this layer in BF16."
            )
        else:
            fix = (
                "The config is online (it quantizes BF16 weights at load), but this checkpoint is pre-quantized: "
                "omit the "
                "quantization argument and give the transformer's config.json its quantization_config "
                "(is_checkpoint_mxfp4_serialized / is_checkpoint_serialized: true; vllm-omni-mxfp4 merge writes it)."
            )

        def load(param: Parameter, loaded_weight: torch.Tensor, *shard: Any) -> None:
            if not loaded_weight.is_floating_point():
                raise ValueError(
                    f"{prefix}.weight: the {method} config keeps this Linear in BF16 ({why}), but the checkpoint "
                    f"holds {loaded_weight.dtype} {tuple(loaded_weight.shape)}, a quantized layer's packed FP4 "
                    f"weight. {fix}"
                )
            vllm_loader(param, loaded_weight, *shard)

        super().create_weights(layer, *args, weight_loader=load, **extra_weight_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        for name in ("weight", "bias"):
            param = getattr(layer, name, None)
            if param is not None:
                check_values(f"{self.route.prefix}.{name}", VALUE_RULES["finite"], param.data)
        super().process_weights_after_loading(layer)
