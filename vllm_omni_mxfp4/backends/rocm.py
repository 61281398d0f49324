"""The ROCm backend: AITER's MXFP4 kernels on AMD Instinct MI355X (gfx950) (research/kernels.md §4).

- Online weights and activations: AITER's HIP per-1x32 quantizer
  ``aiter.get_hip_quant(aiter.QuantType.per_1x32)`` (FP4 E2M1, one E8M0 scale per 32).
- Weights, online or from an offline single-scale checkpoint (packed FP4 + E8M0 scales, whatever
  rule made them), are padded to AITER's tile multiples (N to 16, K to 64, with zero bytes and zero
  codes), the bytes shuffled with ``aiter.ops.shuffle.shuffle_weight(w, layout=(16, 16))`` and
  the scales with ``aiter.utility.fp4_utils.e8m0_shuffle``. The shuffled bytes replace the
  ``weight`` parameter's storage (same shape) and ``state_dict()`` un-shuffles them, so the state
  dict keeps the checkpoint tensors without a second copy on the GPU.
- Forward: Smooth (``mul_scale``) multiplies the activations in their dtype, float32 activations
  are rounded to bf16 (AITER quantizes bf16/fp16), then one custom op
  ``vllm_omni_mxfp4::rocm_mxfp4_gemm`` (with a fake implementation, so ``torch.compile`` traces
  around it) quantizes the activations with shuffled scales and runs ``aiter.gemm_a4w4`` with a
  bf16 output. The bias is added afterwards in float32 (some ``gemm_a4w4`` paths drop their bias
  argument) and the result cast to the caller's dtype, so fp16 and float32 callers see
  bf16-rounded GEMM results.

The scale rule is AITER's, not the config's FLOOR: the HIP quantizer used round-half-up to a power
of two ("aiter_legacy") up to May 2026 and RCEIL since AITER #3212 (2026-06). The backend records
which one the installed AITER uses by quantizing three probe blocks (maxima 1.5, 1.75 and 6.5
tell FLOOR, EVEN, RCEIL and the legacy rule apart) and cross-checks it with
``aiter.utility.mx_types.MX_DEFAULT_ROUND_MODE`` where that exists. ``EmulatedBackend(
mirror="rocm:<rule>")`` reproduces the same numerics on any device.

What AITER cannot run is refused with ``NotImplementedError`` naming the alternatives: UOS
activations (``mxfp4_scale_alg=2``), W4A8 fallback, and ``mxfp4_dualscale``. The backend also
refuses any GPU but gfx950 (``gemm_a4w4`` does not run on gfx942 / MI300).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from types import ModuleType

import torch
import torch.nn.functional as F

from ..formats import MX_BLOCK_SIZE
from .base import (
    MxBackend,
    MxLayerSpec,
    adopt_weight_storage,
    aiter_refusal,
    check_aiter_supported,
    padded_weight,
    restore_checkpoint_weight,
    set_buffer,
)

logger = logging.getLogger(__name__)

WHO = "the ROCm backend (AITER)"
#: AITER tile multiples of ``shuffle_weight(layout=(16, 16))`` on packed FP4: N % 16, (K/2) % 32.
N_MULTIPLE = 16
K_MULTIPLE = 64
#: Probe block maxima and the E8M0 codes each rule gives them (research/kernels.md §1.2).
PROBE_AMAX = (1.5, 1.75, 6.5)
RULE_BY_PROBE_CODES: dict[tuple[int, ...], str] = {
    (125, 125, 127): "floor",
    (125, 126, 127): "even",
    (125, 126, 128): "rceil",
    (126, 126, 128): "aiter_legacy",
}
_ROUND_MODE_RULES = {"RoundUp": "rceil", "Even": "even", "RoundDown": "floor"}


def gpu_arch() -> str | None:
    """The ROCm GPU's ``gcnArchName`` (e.g. ``gfx950:sramecc+:xnack-``), or None without a ROCm GPU."""
    if getattr(torch.version, "hip", None) is None or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return getattr(props, "gcnArchName", "") or "unknown"


def import_aiter() -> ModuleType:
    """AITER, or a clear error saying what the ROCm backend needs."""
    try:
        return importlib.import_module("aiter")
    except ImportError as exc:
        raise RuntimeError(
            "MXFP4 backend 'rocm' needs AITER (amd-aiter) on a ROCm gfx950 GPU "
            f"(import failed: {exc}). Use backend 'emulated' to run the same numerics on any device."
        ) from exc


def aiter_rule_from_metadata() -> tuple[str | None, str]:
    """The scale rule the installed AITER's metadata implies (None: unknown), and where it came from."""
    try:
        mx_types = importlib.import_module("aiter.utility.mx_types")
    except ImportError:
        return "aiter_legacy", "aiter.utility.mx_types is absent (AITER before the 2026-06 RoundUp default)"
    mode = getattr(mx_types, "MX_DEFAULT_ROUND_MODE", None)
    if mode is None:
        return None, "aiter.utility.mx_types has no MX_DEFAULT_ROUND_MODE"
    name = getattr(mode, "name", None) or str(mode).rsplit(".", 1)[-1]
    return _ROUND_MODE_RULES.get(name), f"aiter.utility.mx_types.MX_DEFAULT_ROUND_MODE is {name}"


def unshuffle_weight(shuffled: torch.Tensor) -> torch.Tensor:
    """Inverse of AITER ``shuffle_weight(w, layout=(16, 16))`` on packed FP4 bytes (N, K/2)."""
    n, kb = shuffled.shape
    blocks = shuffled.view(torch.uint8).reshape(n // 16, kb // 32, 2, 16, 16)  # n0, k0, k1, n1, k2
    return blocks.permute(0, 3, 1, 2, 4).reshape(n, kb).contiguous()


@functools.cache
def _gemm_takes_out(gemm) -> tuple[bool, bool]:
    """Whether ``gemm_a4w4`` wants a preallocated ``out`` (older AITER) and knows ``bpreshuffle``."""
    params = inspect.signature(gemm).parameters
    return "out" in params, "bpreshuffle" in params


def _gemm_a4w4(aiter: ModuleType, a, b, a_scale, b_scale) -> torch.Tensor:
    takes_out, knows_preshuffle = _gemm_takes_out(aiter.gemm_a4w4)
    if not takes_out:
        return aiter.gemm_a4w4(a, b, a_scale, b_scale, dtype=torch.bfloat16, bpreshuffle=True)
    m = a.shape[0]
    out = torch.empty((-(-m // 32) * 32, b.shape[0]), dtype=torch.bfloat16, device=a.device)
    kwargs = {"bpreshuffle": True} if knows_preshuffle else {}
    aiter.gemm_a4w4(a, b, a_scale, b_scale, out, **kwargs)
    return out[:m]


@torch.library.custom_op("vllm_omni_mxfp4::rocm_mxfp4_gemm", mutates_args=())
def rocm_mxfp4_gemm(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out_features: int
) -> torch.Tensor:
    """AITER: per-1x32 FP4 quantization of ``x`` (M, Kp) bf16/fp16 with shuffled scales, then
    ``gemm_a4w4`` against the preshuffled weight; (M, out_features) bf16, no bias."""
    aiter = importlib.import_module("aiter")
    x_q, x_scale = aiter.get_hip_quant(aiter.QuantType.per_1x32)(x, shuffle=True)
    out = _gemm_a4w4(aiter, x_q, weight, x_scale, weight_scale)
    return out[:, :out_features].contiguous() if out.shape[1] != out_features else out


@rocm_mxfp4_gemm.register_fake
def _rocm_mxfp4_gemm_fake(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out_features: int
) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features), dtype=torch.bfloat16)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class RocmBackend(MxBackend):
    """Single-scale MXFP4 Linears (online or offline) on gfx950 through AITER."""

    name = "rocm"

    def __init__(self) -> None:
        arch = gpu_arch()
        if arch is None or "gfx950" not in arch:
            found = "no ROCm GPU" if arch is None else f"a {arch} GPU"
            raise NotImplementedError(
                f"MXFP4 backend 'rocm' needs an AMD gfx950 GPU (MI350X/MI355X); found {found}. AITER's MXFP4 "
                "GEMM (gemm_a4w4) does not run on gfx942 (MI300). Use backend 'emulated' (any device) or an "
                "Ascend 950 NPU (backend 'npu')."
            )
        self.arch = arch
        self.aiter = import_aiter()
        self._quant = self.aiter.get_hip_quant(self.aiter.QuantType.per_1x32)
        self._shuffle_weight = importlib.import_module("aiter.ops.shuffle").shuffle_weight
        self._e8m0_shuffle = importlib.import_module("aiter.utility.fp4_utils").e8m0_shuffle
        self.metadata_rule, self.metadata_reason = aiter_rule_from_metadata()
        self._rule: str | None = None

    def describe(self) -> str:
        rule = self._rule or f"not probed yet; {self.metadata_reason}"
        return f"rocm (AITER on {self.arch}; scale rule {rule})"

    def check_supported(self, prefix: str, *, dual_scale: bool, scale_rule: str, w4a8: bool) -> None:
        check_aiter_supported(prefix, dual_scale=dual_scale, scale_rule=scale_rule, w4a8=w4a8, who=WHO)

    def scale_rule(self, device: torch.device) -> str:
        """The E8M0 rule of the installed AITER's per-1x32 quantizer, probed once on ``device``."""
        if self._rule is not None:
            return self._rule
        probe = torch.zeros(1, MX_BLOCK_SIZE * len(PROBE_AMAX), dtype=torch.bfloat16, device=device)
        for i, amax in enumerate(PROBE_AMAX):
            probe[0, i * MX_BLOCK_SIZE] = amax
        _, scale = self._quant(probe, shuffle=False)
        codes = tuple(int(c) for c in scale.view(torch.uint8)[0, : len(PROBE_AMAX)].tolist())
        rule = RULE_BY_PROBE_CODES.get(codes)
        if rule is None:
            raise RuntimeError(
                f"AITER's per-1x32 quantizer gave E8M0 codes {codes} for blocks with maxima {PROBE_AMAX}, which "
                f"match no known scale rule ({RULE_BY_PROBE_CODES}); the emulated backend cannot mirror it"
            )
        if self.metadata_rule is not None and self.metadata_rule != rule:
            logger.warning(
                "AITER's per-1x32 quantizer behaves as scale rule %r, but %s (rule %r); using what it does",
                rule,
                self.metadata_reason,
                self.metadata_rule,
            )
        logger.info(
            "vllm-omni-mxfp4: AITER per-1x32 MXFP4 quantizer uses scale rule %r (probe codes %s; %s). Online "
            "weights and activations follow it, not FLOOR; EmulatedBackend(mirror='rocm:%s') reproduces it.",
            rule,
            codes,
            self.metadata_reason,
            rule,
        )
        self._rule = rule
        return rule

    # ------------------------------------------------------------------ weights

    def quantize_weight(self, weight: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
        check_aiter_supported("", dual_scale=False, scale_rule=scale_rule, w4a8=False, who=WHO)
        if weight.dtype not in (torch.bfloat16, torch.float16):
            weight = weight.to(torch.bfloat16)  # AITER's HIP quantizer takes bf16/fp16
        self.scale_rule(weight.device)
        k = weight.shape[-1]
        padded = F.pad(weight, (0, _round_up(k, MX_BLOCK_SIZE) - k)).contiguous()
        data, scale = self._quant(padded, shuffle=False)
        data = data.view(torch.uint8)[:, : k // 2].contiguous()
        scale = scale.view(torch.uint8)[:, : -(-k // MX_BLOCK_SIZE)].contiguous()
        return data, scale

    def quantize_weight_dualscale(
        self, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise aiter_refusal("", dual_scale=True, scale_rule="floor", w4a8=False, who=WHO)

    def prepare(self, layer: torch.nn.Module, spec: MxLayerSpec) -> None:
        check_aiter_supported(
            spec.prefix, dual_scale=spec.dual_scale, scale_rule=spec.act_scale_rule, w4a8=False, who=WHO
        )
        restore_checkpoint_weight(layer)
        n = spec.out_features
        k_total = spec.k_pad_front + spec.in_features + spec.k_pad_back
        groups = -(-k_total // MX_BLOCK_SIZE)
        scale = layer.weight_scale
        if scale.dtype != torch.uint8 or tuple(scale.shape) != (n, groups):
            raise ValueError(
                f"{spec.prefix}.weight_scale: expected uint8 E8M0 codes (N, {groups}) = ({n}, {groups}), got "
                f"{scale.dtype} {tuple(scale.shape)}"
            )
        weight = padded_weight(layer, spec)
        self.scale_rule(weight.device)
        k_aligned, n_aligned = _round_up(k_total, K_MULTIPLE), _round_up(n, N_MULTIPLE)
        weight = F.pad(weight, (0, (k_aligned - k_total) // 2, 0, n_aligned - n)).contiguous()
        scale = F.pad(scale, (0, k_aligned // MX_BLOCK_SIZE - groups, 0, n_aligned - n)).contiguous()
        shuffled = self._shuffle_weight(weight.view(torch.float4_e2m1fn_x2), layout=(16, 16))
        if tuple(shuffled.shape) == tuple(layer.weight.shape):
            adopt_weight_storage(layer, shuffled.view(torch.uint8), unshuffle_weight)
        set_buffer(layer, "_mx_rocm_weight", shuffled)
        set_buffer(layer, "_mx_rocm_scale", self._e8m0_shuffle(scale.view(torch.float8_e8m0fnu)))
        layer._mx_rocm_k_extra = k_aligned - k_total

    # ------------------------------------------------------------------ forward

    def linear(
        self,
        layer: torch.nn.Module,
        spec: MxLayerSpec,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        a8: bool,
    ) -> torch.Tensor:
        if a8:
            check_aiter_supported(spec.prefix, dual_scale=False, scale_rule="floor", w4a8=True, who=WHO)
        out_dtype = x.dtype
        if spec.has_smooth:
            x = x * layer._mx_smooth.to(x.dtype)
        if x.dtype not in (torch.bfloat16, torch.float16):
            x = x.to(torch.bfloat16)
        front, back = spec.k_pad_front, spec.k_pad_back + layer._mx_rocm_k_extra
        if front or back:
            x = F.pad(x, (front, back))
        out = torch.ops.vllm_omni_mxfp4.rocm_mxfp4_gemm(
            x.contiguous(), layer._mx_rocm_weight, layer._mx_rocm_scale, spec.out_features
        )
        if bias is not None:
            out = out.float() + bias.float()
        return out.to(out_dtype)
