"""What the two MXFP4 Linear methods share: weight creation and loading, post-processing, forward.

Life of a quantized Linear:

- ``create_weights``: online, a BF16 ``weight`` on the meta device (no memory); offline, the
  checkpoint tensors (``weight`` packed uint8 (N, K/2), ``weight_scale`` uint8 (N, G), plus
  ``weight_dual_scale`` / ``mul_scale``). Every parameter gets a loader wrapper that validates the
  checkpoint tensor (names it in errors), converts numeric FP4 weights to packed bytes, and counts
  the elements it wrote, so the method knows when a parameter is complete (fused Q/K/V arrive in
  three pieces).
- Online: the moment the last element of a layer's weight is loaded, the BF16 weight is quantized
  by the backend and freed, so loading never holds more than one BF16 layer above the quantized
  model.
- ``process_weights_after_loading``: checks completeness and Smooth, then lets the backend build
  its kernel-ready tensors (non-persistent buffers). Idempotent.
- ``apply``: Smooth, activation quantization (A4 per scale rule, or A8 on W4A8 routes/steps), GEMM,
  bias, in the caller's dtype, for any leading shape. The A4/A8 decision is made per call from the
  step provider, with no state on the layer. Under ``torch.compile`` the whole call is one opaque
  custom op, so a new denoising step never triggers a recompilation.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.nn import Parameter
from torch.utils._python_dispatch import TorchDispatchMode
from vllm.model_executor.layers.linear import LinearMethodBase, RowParallelLinear
from vllm.model_executor.utils import set_weight_attrs

from ..backends import MxLayerSpec, get_backend
from ..config import LayerRoute, Precision, QuantConfig
from ..formats import DUAL_BLOCK_SIZE, MX_BLOCK_SIZE, NAN_CODE, e2m1_decode, e2m1_encode, pack_fp4
from . import trace

logger = logging.getLogger(__name__)

_FLOATS = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)


class _CopyCounter(TorchDispatchMode):
    """Counts the elements copied into one storage while a loader runs."""

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self.ptr = target.untyped_storage().data_ptr()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[0].untyped_storage().data_ptr() == self.ptr:
            self.count += args[0].numel()
        return func(*args, **(kwargs or {}))


# Layers reachable from the custom op by an integer handle (weak: a dropped model is collected).
_LAYERS: dict[int, weakref.ref] = {}
_HANDLES = itertools.count(1)


def _layer_for(handle: int) -> torch.nn.Module:
    layer = _LAYERS[handle]()
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


@dataclass
class _LoadState:
    """Per-layer loading bookkeeping (plain Python, not in the state dict).

    A row-parallel shard owns K elements ``[k0, k0 + k)`` of the checkpoint's ``k_full``. When that
    range does not start or end on a scale-block boundary (DualScale: 512; single scale: 32), the
    shard keeps the scales of every block it touches and pads ``front`` / ``back`` zero elements
    around its K at run time so that blocks line up; its online weight is quantized over that
    block-aligned range, exactly as TP=1 quantizes those blocks.
    """

    k_full: int
    k: int
    k0: int = 0
    front: int = 0
    back: int = 0
    sharded: bool = False
    loaded: dict[str, int] = field(default_factory=dict)
    load_device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def k_padded(self) -> int:
        return self.front + self.k + self.back


class MxLinearMethod(LinearMethodBase):
    """Base of :class:`Mxfp4LinearMethod` and :class:`Mxfp4DualScaleLinearMethod`."""

    dual_scale: ClassVar[bool] = False
    method_name: ClassVar[str] = ""

    def __init__(self, config: QuantConfig, route: LayerRoute, prefix: str) -> None:
        super().__init__()
        self.config = config
        self.route = route
        self.prefix = prefix
        self.backend = get_backend(config.backend)
        self.online = not config.is_serialized
        # Refuse what the backend cannot run now, before any weight is allocated.
        self.backend.check_supported(
            prefix,
            dual_scale=self.dual_scale,
            scale_rule=self.act_scale_rule,
            w4a8=route.precision is Precision.W4A8 or bool(route.a8_steps),
        )
        # Read by vLLM-Omni's Wan post-load summary.
        self.is_w4a8_fallback_layer = route.precision is Precision.W4A8

    # ------------------------------------------------------------------ format-specific hooks

    @property
    def weight_scale_rule(self) -> str:
        """Scale rule of online weight quantization."""
        return "floor"

    @property
    def act_scale_rule(self) -> str:
        """Scale rule of A4 activations."""
        return "floor"

    def _extra_checkpoint_params(self, layer: torch.nn.Module, n: int, k: int) -> None:
        """Register format-specific offline parameters (dual scale, Smooth)."""

    def _smooth_required(self) -> bool:
        return False

    # ------------------------------------------------------------------ weight creation

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
        """Register the layer's parameters: a lazy BF16 weight (online) or the checkpoint tensors."""
        layer_loader = extra_weight_attrs.pop("weight_loader")
        self._layer_loader = layer_loader
        n, k = sum(output_partition_sizes), input_size_per_partition
        if k % 2:
            raise ValueError(f"{self.prefix}: MXFP4 needs an even input size per partition, got K={k}")
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = k
        layer.output_size_per_partition = n
        layer.orig_dtype = params_dtype
        default_device = torch.get_default_device()
        state = self._shard_geometry(layer, k, input_size)
        state.load_device = torch.device("cpu") if default_device.type == "meta" else default_device
        layer._mx_load = state
        layer._mx_spec = None
        handle = next(_HANDLES)
        _LAYERS[handle] = weakref.ref(layer)
        layer._mx_handle = handle
        if self.online:
            weight = torch.empty(n, state.k_padded, dtype=params_dtype, device="meta")
            self._register(
                layer,
                "weight",
                Parameter(weight, requires_grad=False),
                {"input_dim": 1, "output_dim": 0},
                layer_loader,
            )
            return
        packed = torch.empty(n, k // 2, dtype=torch.uint8)
        self._register(
            layer,
            "weight",
            Parameter(packed, requires_grad=False),
            {"input_dim": 1, "output_dim": 0, "is_checkpoint_required": True},
            layer_loader,
        )
        scale = torch.empty(n, -(-state.k_padded // MX_BLOCK_SIZE), dtype=torch.uint8)
        self._register(
            layer,
            "weight_scale",
            Parameter(scale, requires_grad=False),
            {"input_dim": 1, "output_dim": 0, "is_checkpoint_required": True},
            layer_loader,
        )
        self._extra_checkpoint_params(layer, n, state.k_padded)
        smooth = torch.full((k,), float("nan"), dtype=torch.float32)
        self._register(
            layer,
            "mul_scale",
            Parameter(smooth, requires_grad=False),
            {
                "input_dim": 0,
                "ignore_warning": True,
                "is_checkpoint_required": self._smooth_required(),
                "is_checkpoint_optional": not self._smooth_required(),
            },
            layer_loader,
        )

    def _shard_geometry(self, layer: torch.nn.Module, k: int, k_full: int) -> _LoadState:
        """Where this partition's K sits in the checkpoint's, and the padding that aligns it."""
        if not (isinstance(layer, RowParallelLinear) and layer.tp_size > 1):
            return _LoadState(k_full=k_full, k=k)
        block = DUAL_BLOCK_SIZE if self.dual_scale else MX_BLOCK_SIZE
        k0 = layer.tp_rank * k
        front, back = k0 % block, -(k0 + k) % block
        if front or back:
            logger.info(
                "%s: K=%d split over TP=%d gives %d per rank, not a multiple of %d; rank %d pads %d+%d zero "
                "inputs to line its blocks up with the checkpoint's",
                self.prefix,
                k_full,
                layer.tp_size,
                k,
                block,
                layer.tp_rank,
                front,
                back,
            )
        return _LoadState(k_full=k_full, k=k, k0=k0, front=front, back=back, sharded=True)

    def _register(
        self,
        layer: torch.nn.Module,
        name: str,
        param: Parameter,
        attrs: dict[str, Any],
        layer_loader,
    ) -> None:
        layer.register_parameter(name, param)
        set_weight_attrs(param, {**attrs, "weight_loader": self._make_loader(layer, name, layer_loader)})

    # ------------------------------------------------------------------ loading

    def _make_loader(self, layer: torch.nn.Module, name: str, layer_loader):
        """A weight loader for parameter ``name`` that validates, converts and counts."""

        def load(param: Parameter, loaded_weight: torch.Tensor, *args: Any) -> None:
            loaded_weight = self._check_checkpoint_tensor(layer, name, loaded_weight)
            target = getattr(layer, name)
            if target.is_meta:
                target = self._materialize(layer, name)
            # Fused Q/K/V: one Smooth tensor per projection, all three must agree.
            if (
                name == "mul_scale"
                and layer._mx_load.loaded.get(name)
                and not torch.equal(target.data.to(loaded_weight.dtype), loaded_weight.to(target.device))
            ):
                raise ValueError(f"Fused Q/K/V must share the same Smooth tensor: {self.prefix}.mul_scale")
            counter = _CopyCounter(target)
            try:
                with counter:
                    if layer._mx_load.sharded:
                        target.data.copy_(self._row_shard(layer, name, loaded_weight))
                    else:
                        layer_loader(target, loaded_weight, *args)
            except (AssertionError, RuntimeError) as exc:
                raise ValueError(
                    f"{self.prefix}.{name}: checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit "
                    f"the parameter of shape {tuple(target.shape)} (layer {type(layer).__name__}): {exc}"
                ) from exc
            loaded = layer._mx_load.loaded.get(name, 0) + counter.count
            layer._mx_load.loaded[name] = loaded
            if self.online and name == "weight" and loaded >= target.numel():
                self._quantize_online(layer)

        return load

    def _materialize(self, layer: torch.nn.Module, name: str) -> Parameter:
        meta = getattr(layer, name)
        real = Parameter(
            torch.empty(meta.shape, dtype=meta.dtype, device=layer._mx_load.load_device), requires_grad=False
        )
        set_weight_attrs(real, {k: v for k, v in vars(meta).items() if not k.startswith("_")})
        layer.register_parameter(name, real)
        return real

    def _row_shard(self, layer: torch.nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor of a row-parallel layer (K is sharded)."""
        st = layer._mx_load
        lo, hi = st.k0 - st.front, st.k0 + st.k + st.back  # block-aligned element range
        if name == "mul_scale":
            return t[st.k0 : st.k0 + st.k]
        if name == "weight" and not self.online:
            return t[:, st.k0 // 2 : (st.k0 + st.k) // 2]
        if name == "weight":
            return _columns(t, lo, hi)
        if name == "weight_scale":
            return _columns(t, lo // MX_BLOCK_SIZE, hi // MX_BLOCK_SIZE)
        if name == "weight_dual_scale":
            return _columns(t, lo // DUAL_BLOCK_SIZE, hi // DUAL_BLOCK_SIZE)
        raise ValueError(f"{self.prefix}.{name}: no row-parallel sharding rule for this tensor")

    def _check_checkpoint_tensor(self, layer: torch.nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
        """Validate a checkpoint tensor against the format; returns it in the parameter's layout."""
        where = f"{self.prefix}.{name}"
        k_full = layer._mx_load.k_full
        if self.online:
            if name != "weight":
                raise ValueError(f"{where}: online {self.method_name} loads only BF16 weights, got '{name}'")
            if t.dtype == torch.uint8 or t.shape[-1] != k_full:
                raise ValueError(
                    f"{where}: online {self.method_name} expects a BF16/FP16/FP32 weight (N, {k_full}), got "
                    f"{t.dtype} {tuple(t.shape)}; for a pre-quantized checkpoint declare "
                    f"is_checkpoint_{'' if self.dual_scale else 'mxfp4_'}serialized"
                )
            return t
        if name == "weight":
            return _as_packed(t, k_full, where)
        if name == "weight_scale":
            if t.dtype == getattr(torch, "float8_e8m0fnu", None):
                t = t.view(torch.uint8)
            groups = -(-k_full // MX_BLOCK_SIZE)
            if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[-1] != groups:
                raise ValueError(
                    f"{where}: expected uint8 E8M0 codes (N, {groups}), got {t.dtype} {tuple(t.shape)}"
                )
            return t
        if name == "weight_dual_scale":
            chunks = -(-k_full // DUAL_BLOCK_SIZE)
            if not t.is_floating_point() or t.dim() != 3 or t.shape[1:] != (chunks, 1):
                raise ValueError(
                    f"{where}: expected float32 coarse scales (N, {chunks}, 1), got {t.dtype} {tuple(t.shape)}"
                )
            return t.float()
        if name == "mul_scale":
            if not t.is_floating_point() or t.dim() != 1 or t.shape[0] != k_full:
                raise ValueError(
                    f"{where}: expected a float32 Smooth vector ({k_full},), got {t.dtype} {tuple(t.shape)}"
                )
            bad = ~torch.isfinite(t) | (t <= 0)
            if bool(bad.any()):
                raise ValueError(
                    f"{where}: Smooth scales must be finite and positive; {int(bad.sum())} of {t.numel()} "
                    f"are not (first at index {int(bad.nonzero()[0])}: {t[bad][0].item()})"
                )
            return t.float()
        return t

    def _quantize_online(self, layer: torch.nn.Module) -> None:
        """Quantize the completely loaded BF16 weight and drop it."""
        weight = layer.weight.data
        st = layer._mx_load
        if self.dual_scale:
            packed, scale, dual = self.backend.quantize_weight_dualscale(weight)
        else:
            packed, scale = self.backend.quantize_weight(weight, self.weight_scale_rule)
            dual = None
        if st.front or st.back:
            packed = packed[:, st.front // 2 : (st.front + st.k) // 2].contiguous()
        attrs = {"input_dim": 1, "output_dim": 0}
        layer.register_parameter("weight", Parameter(packed, requires_grad=False))
        set_weight_attrs(layer.weight, attrs)
        layer.register_parameter("weight_scale", Parameter(scale, requires_grad=False))
        set_weight_attrs(layer.weight_scale, attrs)
        if dual is not None:
            layer.register_parameter("weight_dual_scale", Parameter(dual.unsqueeze(-1), requires_grad=False))
            set_weight_attrs(layer.weight_dual_scale, attrs)
        del weight
        self._prepare(layer, smooth=None)
        layer._already_called_process_weights_after_loading = True

    # ------------------------------------------------------------------ after loading

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check that every required tensor arrived, validate Smooth, let the backend prepare."""
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        loaded = layer._mx_load.loaded
        if self.online:
            got = loaded.get("weight", 0)
            raise ValueError(
                f"{self.prefix}.weight: online {self.method_name} needs the complete BF16 weight, but "
                f"{got} of {layer.weight.numel()} elements were loaded"
            )
        for name, param in list(layer.named_parameters(recurse=False)):
            if name == "bias" or getattr(param, "is_checkpoint_optional", False):
                continue
            if loaded.get(name, 0) < param.numel():
                raise ValueError(
                    f"{self.prefix}.{name}: required by offline {self.method_name} but "
                    f"{'missing from' if not loaded.get(name) else 'incomplete in'} the checkpoint"
                )
        nan_rows = (layer.weight_scale.data == NAN_CODE).any(dim=1)
        if bool(nan_rows.any()):
            raise ValueError(
                f"{self.prefix}.weight_scale: E8M0 code 0xFF (NaN) in {int(nan_rows.sum())} rows (first row "
                f"{int(nan_rows.nonzero()[0])}); the checkpoint is corrupt"
            )
        smooth = None
        if loaded.get("mul_scale"):
            smooth = self._validated_smooth(layer)
        else:
            del layer._parameters["mul_scale"]
        self._drop_unused_params(layer)
        self._prepare(layer, smooth)
        layer._already_called_process_weights_after_loading = True

    def _drop_unused_params(self, layer: torch.nn.Module) -> None:
        """Remove placeholder parameters that are not checkpoint tensors of this format."""

    def _validated_smooth(self, layer: torch.nn.Module) -> torch.Tensor | None:
        """The Smooth multiplier in the activation dtype, or None when it is all ones."""
        smooth = layer.mul_scale.data
        cast = smooth.to(layer.orig_dtype)
        bad = ~torch.isfinite(cast) | (cast <= 0)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"{self.prefix}.mul_scale: value {smooth[i].item()} at index {i} is not finite and positive "
                f"in the activation dtype {layer.orig_dtype}"
            )
        if bool((cast == 1).all()):
            return None
        return cast

    def _prepare(self, layer: torch.nn.Module, smooth: torch.Tensor | None) -> None:
        if smooth is not None:
            layer.register_buffer("_mx_smooth", smooth, persistent=False)
        spec = MxLayerSpec(
            prefix=self.prefix,
            dual_scale=self.dual_scale,
            act_scale_rule=self.act_scale_rule,
            in_features=layer.input_size_per_partition,
            out_features=layer.output_size_per_partition,
            has_smooth=smooth is not None,
            k_pad_front=layer._mx_load.front,
            k_pad_back=layer._mx_load.back,
        )
        self.backend.prepare(layer, spec)
        layer._mx_spec = spec

    # ------------------------------------------------------------------ forward

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ W^T + bias`` with MXFP4 weights and MXFP4/MXFP8 activations."""
        if torch.compiler.is_compiling():
            return torch.ops.vllm_omni_mxfp4.linear(x, bias, layer._mx_handle)
        return self.forward(layer, x, bias)

    def forward(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The eager forward (also the body of the custom op)."""
        spec = layer._mx_spec
        if spec is None:
            raise RuntimeError(
                f"{self.prefix}: process_weights_after_loading() has not run; load the model through "
                "vLLM-Omni's loader or call it on every quantized layer after load_weights()"
            )
        a8 = self.route.precision_now() is Precision.W4A8
        if trace.TRACE is not None:
            trace.TRACE.record(layer, self.method_name, self.prefix, a8, self.backend.name)
        out = self.backend.linear(layer, spec, x.reshape(-1, x.shape[-1]), bias, a8=a8)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _as_packed(t: torch.Tensor, k_full: int, where: str) -> torch.Tensor:
    """A checkpoint weight as packed E2M1 bytes: uint8 (N, K/2) as is, numeric FP4 (N, K) packed."""
    if t.dtype == torch.uint8:
        if t.dim() != 2 or t.shape[-1] != k_full // 2:
            raise ValueError(
                f"{where}: packed FP4 weight must be uint8 (N, {k_full // 2}), got {tuple(t.shape)}"
            )
        return t
    if t.dtype not in _FLOATS or t.dim() != 2 or t.shape[-1] != k_full:
        raise ValueError(
            f"{where}: expected packed uint8 (N, {k_full // 2}) or numeric FP4 values (N, {k_full}) in a float "
            f"dtype, got {t.dtype} {tuple(t.shape)}"
        )
    values = t.float()
    codes = e2m1_encode(values)
    off_grid = e2m1_decode(codes) != values
    if bool(off_grid.any()):
        first = values[off_grid][0].item()
        raise ValueError(
            f"{where}: numeric weight holds values that are not FP4 E2M1 numbers ({int(off_grid.sum())} of "
            f"{values.numel()}, e.g. {first}); an offline checkpoint stores E2M1 values (or packed bytes) and "
            "the E8M0 scales separately"
        )
    return pack_fp4(codes)


def _columns(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Columns [lo, hi) of dim 1, zero-filled past the end (a shard's last block past K)."""
    have = t[:, lo : min(hi, t.shape[1])]
    if have.shape[1] == hi - lo:
        return have
    pad = torch.zeros((t.shape[0], hi - lo - have.shape[1], *t.shape[2:]), dtype=t.dtype, device=t.device)
    return torch.cat((have, pad), dim=1)
