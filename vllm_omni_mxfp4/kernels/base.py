"""The kernel interface: one implementation per (format, backend), as vLLM's ``kernels/linear/mxfp4``.

A quantized Linear keeps its checkpoint tensors as parameters under the checkpoint's names
(``weight`` packed uint8 (N, K/2), ``weight_scale`` uint8 (N, G), ``weight_dual_scale`` float32
(N, C, 1), ``mul_scale`` float32 (K,)). A kernel serves one format on one backend:

- :meth:`MxKernel.is_supported` (hardware and libraries present, for ``auto``) and
  :meth:`MxKernel.can_implement` (this layer's format, scale rule and precisions), each
  ``(ok, reason)``; the reason of a refusal names what is unsupported, why, and the alternatives;
- :meth:`MxKernel.quantize_weight`: online weight quantization, once at load, into the
  checkpoint tensors;
- :meth:`MxKernel.prepare`: after loading, the kernel-ready tensors of one layer, in ONE
  :class:`Prepared` module that the layer holds as a child (non-persistent buffers: ``module.to()``
  moves them, ``state_dict()`` skips them);
- :meth:`MxKernel.apply`: ``y = x W^T + b`` for a 2-D activation in the caller's dtype. The
  preamble every kernel shares (Smooth, the bf16 cast of float32 inputs, K padding) is written once
  here and configured by class attributes; the kernel writes only its quantize-and-GEMM step.

A kernel that keeps its layout in the ``weight`` parameter's own storage (FRACTAL_NZ on the NPU,
AITER's preshuffled bytes on ROCm) saves a second copy of every weight: :meth:`Prepared.adopt_weight`
records the conversion back, so ``state_dict()`` still returns the checkpoint bytes, and
:meth:`Prepared.release` restores them before another kernel prepares the layer.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..config import Precision
from ..spec import MX_BLOCK, WEIGHT_SCALE

_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SharedBlocks:
    """Activation blocks that a row-parallel shard shares with its neighbour ranks.

    TP=1 quantizes every activation block from its maximum over the whole block (DualScale's coarse
    scale: the 512-element maximum; single scale: the 32-element one). A rank whose K range starts or
    ends inside a block sees only its part of it. Each rank takes its part's maximum of finite |x|
    (after Smooth, in the activation dtype) for every shared block, ``reduce_max`` takes the maximum
    over the TP group (one small all-reduce per forward: the same call, of the same shape, on every
    rank), and :meth:`stamp` writes it into one zero padding element of the block. The quantizer then
    finds the block's true maximum, so each real element is quantized exactly as TP=1 quantizes it,
    and the stamped element meets a zero weight (it adds nothing to the output).

    ``blocks``: global indices of the blocks split between ranks, the same tuple on every rank;
    ``first`` / ``last``: positions in ``blocks`` of this rank's first / last padded block, or None
    when that block is not shared.
    """

    block: int
    blocks: tuple[int, ...]
    first: int | None
    last: int | None
    reduce_max: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def of(
        cls,
        prefix: str,
        k_full: int,
        rank: int,
        tp_size: int,
        block: int,
        reduce_max: Callable[[torch.Tensor], torch.Tensor],
    ) -> SharedBlocks | None:
        """The shared blocks of rank ``rank``'s K shard (``k_full / tp_size`` elements); None if none.

        A stamped element must sit in padding that no finer block of real elements shares: DualScale
        (``block`` 512) needs every rank boundary on a 32-element edge; otherwise ``NotImplementedError``.
        """
        k = k_full // tp_size
        cuts = [r * k for r in range(1, tp_size) if (r * k) % block]
        if not cuts:
            return None
        if block > MX_BLOCK and any(c % MX_BLOCK for c in cuts):
            raise NotImplementedError(
                f"{prefix}: K={k_full} split over TP={tp_size} gives {k} inputs per rank, which splits "
                f"{MX_BLOCK}-element blocks between ranks inside a {block}-element block; the ranks cannot "
                f"reproduce TP=1's quantization there. Use a TP size that divides K into multiples of "
                f"{MX_BLOCK}, or list the layer in ignored_layers (BF16)."
            )
        blocks = tuple(sorted({c // block for c in cuts}))
        k0, end = rank * k, (rank + 1) * k
        first = blocks.index(k0 // block) if k0 % block else None
        last = blocks.index(end // block) if end % block and end < k_full else None  # K's end: zeros
        return cls(block, blocks, first, last, reduce_max)

    def stamp(self, x: torch.Tensor, smooth: torch.Tensor | None) -> torch.Tensor:
        """``x`` (M, Kp), padded to whole blocks, with the group's block maxima in its first / last
        padding element; ``smooth`` (Kp,): the Smooth still to apply in the quantizer (1 on padding)."""
        xs = x if smooth is None else x * smooth
        mag = xs.abs().float()
        mag = torch.where(torch.isfinite(mag), mag, torch.zeros_like(mag))
        local = mag.new_zeros(x.shape[0], len(self.blocks))
        if self.first is not None:
            local[:, self.first] = mag[:, : self.block].amax(dim=-1)
        if self.last is not None:
            local[:, self.last] = torch.maximum(local[:, self.last], mag[:, -self.block :].amax(dim=-1))
        shared = self.reduce_max(local)
        x = x.clone()
        if self.first is not None:
            x[:, 0] = shared[:, self.first].to(x.dtype)
        if self.last is not None:
            x[:, -1] = shared[:, self.last].to(x.dtype)
        return x


@dataclass(frozen=True)
class MxLayerSpec:
    """What a kernel needs to know about one quantized Linear partition."""

    prefix: str
    fmt: str  # "mxfp4", "mxfp4_dualscale" or "mxfp8" (spec.FORMATS)
    scale_rule: str  # the config's rule of online weights and A4 activations: "floor" (OCP) or "uos"
    in_features: int  # K of this partition
    out_features: int  # N of this partition
    w4a8: bool = False  # the layer may run W4A8 (by layer, or on some denoising steps)
    # A row-parallel shard whose K range does not start/end on a scale-block boundary: its checkpoint
    # scales cover the whole blocks it touches, and the kernel pads weights and activations with this
    # many zero elements before/after K so that blocks line up with the checkpoint's. Zero otherwise.
    k_pad_front: int = 0
    k_pad_back: int = 0
    # The padded blocks this shard shares with neighbour ranks and how the ranks agree on their
    # activation maxima (None: TP=1, or every boundary on a block edge).
    shared: SharedBlocks | None = field(default=None, compare=False)

    @property
    def k_padded(self) -> int:
        """K including the block-alignment padding."""
        return self.k_pad_front + self.in_features + self.k_pad_back


class Prepared(torch.nn.Module):
    """The kernel-ready tensors of one layer (buffers) and the facts a forward needs.

    ``smooth``: the Smooth multiplier in the activation dtype, or None. ``k_extra``: zero elements
    the kernel appends to K after the alignment padding (whole tiles or 512-chunks). Kernels add
    their own buffers by keyword (``weight``, ``scale``, ``dequantized``, ...).
    """

    def __init__(
        self, spec: MxLayerSpec, smooth: torch.Tensor | None, **tensors: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.spec = spec
        self.k_extra = 0
        self.weight_to_checkpoint: Callable[[torch.Tensor], torch.Tensor] | None = None
        for name, tensor in {"smooth": smooth, **tensors}.items():
            self.register_buffer(name, tensor, persistent=False)
        self.register_state_dict_post_hook(_checkpoint_weight_hook)

    def adopt_weight(
        self,
        layer: torch.nn.Module,
        device_weight: torch.Tensor,
        to_checkpoint: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Make ``layer.weight`` hold ``device_weight`` (a kernel layout of the same shape).

        The packed checkpoint bytes are released instead of living next to their device copy.
        ``to_checkpoint`` maps the device form back to packed uint8 (N, K/2); ``state_dict()``
        applies it, so the state dict keeps exactly the checkpoint tensors.
        """
        if tuple(device_weight.shape) != tuple(layer.weight.shape):
            raise ValueError(
                f"adopt_weight_storage: device weight {tuple(device_weight.shape)} does not have the weight's "
                f"shape {tuple(layer.weight.shape)}"
            )
        layer.weight.data = device_weight
        self.weight_to_checkpoint = to_checkpoint

    def release(self, layer: torch.nn.Module) -> None:
        """Undo :meth:`adopt_weight`: ``layer.weight`` holds packed uint8 (N, K/2) again."""
        if self.weight_to_checkpoint is not None:
            layer.weight.data = self.weight_to_checkpoint(layer.weight.data)
            self.weight_to_checkpoint = None


def _checkpoint_weight_hook(module: Prepared, state_dict: dict, prefix: str, local_metadata) -> None:
    """Runs after the owning layer saved its parameters: convert an adopted ``weight`` back."""
    owner = prefix[: prefix.rstrip(".").rfind(".") + 1]  # "a.b._mx_prepared." -> "a.b."
    key = owner + "weight"
    if module.weight_to_checkpoint is not None and key in state_dict:
        state_dict[key] = module.weight_to_checkpoint(state_dict[key])


class MxKernel(ABC):
    """One format on one backend: declared capabilities, weight quantization, preparation, forward.

    Class attributes declare what the kernel serves and how its inputs are conditioned:
    ``format`` / ``backend`` (its registry key), ``numerics`` (whose numerics it computes: "npu" or
    "rocm"; what ``VLLM_OMNI_MXFP4_EMULATED_MIRROR`` selects among emulated kernels), ``a4_rules``
    and ``w4a8`` (what it can run), ``refusals`` (message templates for what it cannot, with
    ``{where}``, ``{who}`` and ``{alternatives}``), ``half_input`` (None, "before_smooth" or
    "after_smooth": where float32 activations become bf16), ``smooth_in_quantizer`` (pass Smooth
    to the activation quantizer instead of multiplying) and ``pad_input`` (pad activations by the
    spec's K padding plus ``Prepared.k_extra`` before :meth:`_matmul`).
    """

    format: ClassVar[str]
    backend: ClassVar[str]
    numerics: ClassVar[str] = "npu"
    a4_rules: ClassVar[tuple[str, ...]] = ("floor", "uos")
    w4a8: ClassVar[bool] = False
    refusals: ClassVar[Mapping[str, str]] = {}
    alternatives: ClassVar[str] = ""
    half_input: ClassVar[str | None] = None
    smooth_in_quantizer: ClassVar[bool] = False
    pad_input: ClassVar[bool] = False

    @classmethod
    def is_supported(cls) -> tuple[bool, str]:
        """Whether this machine has the hardware and libraries, and why (what ``auto`` consults)."""
        return True, f"{cls.backend} runs anywhere"

    @property
    def who(self) -> str:
        """The subject of refusal messages."""
        return f"the {self.backend} backend"

    def can_implement(self, spec: MxLayerSpec) -> tuple[bool, str]:
        """Whether this kernel runs ``spec``'s layer; otherwise the refusal naming the alternatives."""
        if spec.fmt != self.format:
            return False, self.refusal(spec.fmt, spec.prefix)
        if spec.scale_rule not in self.a4_rules:
            return False, self.refusal(f"scale_rule:{spec.scale_rule}", spec.prefix)
        if spec.w4a8 and not self.w4a8:
            return False, self.refusal("w4a8", spec.prefix)
        return True, f"{self.who} runs {spec.fmt}"

    def refusal(self, what: str, prefix: str) -> str:
        """The declared refusal message for capability ``what`` (a format, ``scale_rule:<rule>``, ``w4a8``)."""
        where = f"{prefix}: " if prefix else ""
        template = self.refusals.get(what, "{where}" + f"{what} is not supported by " + "{who}.")
        return template.format(where=where, who=self.who, alternatives=self.alternatives)

    def check(self, spec: MxLayerSpec) -> None:
        """Raise ``NotImplementedError`` with the refusal when :meth:`can_implement` says no."""
        ok, reason = self.can_implement(spec)
        if not ok:
            raise NotImplementedError(reason)

    def describe(self) -> str:
        """One line for the selection log: the backend and its options."""
        return self.backend

    # ------------------------------------------------------------------ weights

    def quantize_weight(self, weight: torch.Tensor, spec: MxLayerSpec) -> dict[str, torch.Tensor]:
        """Online weight quantization: (N, K) -> the format's checkpoint tensors, by checkpoint name."""
        self.check(spec)
        return self._quantize_weight(weight, spec)

    def prepare(self, layer: torch.nn.Module, spec: MxLayerSpec, smooth: torch.Tensor | None) -> Prepared:
        """The kernel-ready form of ``layer``'s checkpoint tensors (call :meth:`Prepared.release` of a
        previous preparation first)."""
        self.check(spec)
        return self._prepare(layer, spec, smooth)

    @abstractmethod
    def _quantize_weight(self, weight: torch.Tensor, spec: MxLayerSpec) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def _prepare(
        self, layer: torch.nn.Module, spec: MxLayerSpec, smooth: torch.Tensor | None
    ) -> Prepared: ...

    # ------------------------------------------------------------------ forward

    def apply(
        self,
        layer: torch.nn.Module,
        prepared: Prepared,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        precision: Precision,
    ) -> torch.Tensor:
        """``x`` (M, K) -> (M, N) in ``x``'s dtype at ``precision`` (W4A4, or W4A8 where declared)."""
        if precision is Precision.W4A8 and not self.w4a8:
            raise NotImplementedError(self.refusal("w4a8", prepared.spec.prefix))
        out_dtype = x.dtype
        x, smooth = self._preamble(prepared, x)
        call = Call(layer, prepared, smooth, bias, precision, out_dtype)
        return self._matmul(x, call).to(out_dtype)

    def _preamble(self, prepared: Prepared, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Smooth, the bf16 cast and K padding (shared blocks stamped, :class:`SharedBlocks`), as the
        class attributes declare; returns the Smooth vector still to apply in the quantizer
        (``smooth_in_quantizer``) or None."""
        if self.half_input == "before_smooth" and x.dtype not in _HALF:
            x = x.to(torch.bfloat16)
        smooth = prepared.smooth
        if smooth is not None:
            smooth = smooth.to(x.dtype)
            if not self.smooth_in_quantizer:
                x, smooth = x * smooth, None
        if self.half_input == "after_smooth" and x.dtype not in _HALF:
            x = x.to(torch.bfloat16)
        if not self.pad_input:
            return x, smooth
        spec = prepared.spec
        x, smooth = _pad_k(x, smooth, spec.k_pad_front, spec.k_pad_back)
        if spec.shared is not None:
            x = spec.shared.stamp(x, smooth)
        return _pad_k(x, smooth, 0, prepared.k_extra)

    @abstractmethod
    def _matmul(self, x: torch.Tensor, call: Call) -> torch.Tensor:
        """Quantize the conditioned activations and run the GEMM (bias included)."""


def _pad_k(
    x: torch.Tensor, smooth: torch.Tensor | None, front: int, back: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``front`` / ``back`` zero inputs around K (Smooth padded with ones)."""
    if not (front or back):
        return x, smooth
    return F.pad(x, (front, back)), None if smooth is None else F.pad(smooth, (front, back), value=1.0)


@dataclass(frozen=True)
class Call:
    """One forward call as :meth:`MxKernel._matmul` sees it."""

    layer: torch.nn.Module
    prepared: Prepared
    smooth: torch.Tensor | None  # for kernels whose quantizer applies Smooth
    bias: torch.Tensor | None
    precision: Precision
    out_dtype: torch.dtype

    @property
    def spec(self) -> MxLayerSpec:
        return self.prepared.spec

    def weight(self) -> torch.Tensor:
        """The prepared weight where the kernel made one, else the layer's own ``weight``."""
        weight = getattr(self.prepared, "weight", None)
        return self.layer.weight if weight is None else weight


def padded_weight(layer: torch.nn.Module, spec: MxLayerSpec) -> torch.Tensor:
    """The packed weight (N, K/2) with ``spec.k_pad_front`` / ``k_pad_back`` zero elements around K.

    A row-parallel shard stores only its own K range, while its scales cover every block it
    touches; zero bytes (E2M1 +0) line the bytes up with the scales.
    """
    weight = layer.weight.data
    front, back = spec.k_pad_front, spec.k_pad_back
    if tuple(weight.shape) != (spec.out_features, spec.in_features // 2):
        raise ValueError(
            f"{spec.prefix}.weight: expected packed FP4 (N, K/2) = {(spec.out_features, spec.in_features // 2)}, "
            f"got {tuple(weight.shape)}"
        )
    if front % 2 or back % 2:
        raise ValueError(f"{spec.prefix}: K padding must be even to keep bytes whole, got {front}+{back}")
    if not (front or back):
        return weight
    return F.pad(weight, (front // 2, back // 2))


def checked_scale(layer: torch.nn.Module, spec: MxLayerSpec) -> torch.Tensor:
    """``layer.weight_scale`` after checking it against :data:`vllm_omni_mxfp4.spec.WEIGHT_SCALE`
    for the padded K, before it reaches a vendor kernel."""
    scale = layer.weight_scale
    n, groups = WEIGHT_SCALE.shape(spec.out_features, spec.k_padded)
    if scale.dtype != torch.uint8 or tuple(scale.shape) != (n, groups):
        raise ValueError(
            f"{spec.prefix}.weight_scale: expected uint8 E8M0 codes (N, {groups}) = ({n}, {groups}), got "
            f"{scale.dtype} {tuple(scale.shape)}"
        )
    return scale


def as_uint8(t: torch.Tensor) -> torch.Tensor:
    """Vendor libraries return FP4 / E8M0 bytes as uint8, int8 or their own dtypes: the uint8 view."""
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def installed(name: str) -> bool:
    """Whether module ``name`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # already in sys.modules without a spec (a test double): importable
        return True
