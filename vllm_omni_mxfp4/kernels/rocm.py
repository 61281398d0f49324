"""The ROCm kernel: AITER's MXFP4 kernels on AMD Instinct MI350X/MI355X (gfx950), ``mxfp4`` only.

- Online weights and activations: AITER's HIP per-1x32 quantizer
  ``aiter.get_hip_quant(aiter.QuantType.per_1x32)`` (FP4 E2M1, one E8M0 scale per 32).
- Weights, online or from an offline single-scale checkpoint (packed FP4 + E8M0 scales, whatever
  rule made them), are padded to AITER's tile multiples (N to 256, the asm GEMM's tile widths; K
  to 64; zero bytes and zero codes), the bytes shuffled with ``aiter.ops.shuffle.shuffle_weight(w, layout=(16, 16))`` and
  the scales with ``aiter.utility.fp4_utils.e8m0_shuffle``. The shuffled bytes replace the
  ``weight`` parameter's storage (when the padding leaves the shape unchanged) and ``state_dict()`` un-shuffles them, so the state
  dict keeps the checkpoint tensors without a second copy on the GPU.
- Forward: Smooth (``mul_scale``) multiplies the activations in their dtype, float32 activations
  are rounded to bf16 (AITER quantizes bf16/fp16), then one custom op
  ``vllm_omni_mxfp4::rocm_mxfp4_gemm`` (with a fake implementation, so ``torch.compile`` traces
  around it) quantizes the activations with shuffled scales and runs ``aiter.gemm_a4w4`` with a
  bf16 output (the only output type of the asm kernels). The bias is never passed to
  ``gemm_a4w4``: the asm kernel takes it as the C operand of ``D = alpha * A B + beta * C`` with
  ``beta = 0``, so it would be dropped; it is added afterwards in float32 and the result cast to the
  caller's dtype, so fp16 and float32 callers see bf16-rounded GEMM results.

The scale rule is AITER's, not the config's FLOOR; it changed between AITER versions (see
``docs/kernels.md``). The kernel records which one the installed AITER uses by quantizing three
probe blocks (maxima 1.5, 1.75 and 6.5 tell FLOOR, EVEN, RCEIL and the legacy rule apart) and
cross-checks it with ``aiter.utility.mx_types.MX_DEFAULT_ROUND_MODE`` where that exists.
:class:`~.emulated_rocm.EmulatedAiterSingle` reproduces the same numerics on any device.

What AITER cannot run is declared in :data:`AITER_REFUSALS` (UOS activations, W4A8, DualScale, MXFP8)
and refused with ``NotImplementedError`` naming the alternatives; any GPU but gfx950 is refused
too (``gemm_a4w4`` does not run on gfx942 / MI300).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from types import ModuleType

import torch
import torch.nn.functional as F

from ..spec import MX_BLOCK, ceil_div, round_up
from .base import Call, MxKernel, MxLayerSpec, Prepared, checked_scale, installed, padded_weight

logger = logging.getLogger(__name__)

#: N padding: ``shuffle_weight(layout=(16, 16))`` needs N % 16, but the asm ``gemm_a4w4`` kernels
#: exist only for N a multiple of their tile width (``N % cfg.tile_N == 0`` in AITER's
#: ``get_heuristic_kernel``; 128 or 256 by config), else "cannot get heuristic kernel". A multiple
#: of 256 finds a kernel whatever the installed build's tile table holds.
N_MULTIPLE = 256
#: K padding of ``shuffle_weight(layout=(16, 16))`` on packed FP4: (K/2) % 32.
K_MULTIPLE = 64
#: Probe block maxima and the E8M0 codes each rule gives them (the scale-rule table of ``formats``).
PROBE_AMAX = (1.5, 1.75, 6.5)
RULE_BY_PROBE_CODES: dict[tuple[int, ...], str] = {
    (125, 125, 127): "floor",
    (125, 126, 127): "even",
    (125, 126, 128): "rceil",
    (126, 126, 128): "aiter_legacy",
}
_ROUND_MODE_RULES = {"RoundUp": "rceil", "Even": "even", "RoundDown": "floor"}

AITER_ALTERNATIVES = (
    "Run it with backend 'emulated' (any device, the NPU numerics), or on an Ascend 950 NPU (backend 'npu')"
)
#: What AITER's MXFP4 kernels cannot run (for this kernel and the emulated one mirroring it).
AITER_REFUSALS = {
    "mxfp4_dualscale": "{where}mxfp4_dualscale is not supported by {who}: AITER has no dual-level (per-512 "
    "FP32 + per-32 E8M0) GEMM. {alternatives}, or use single-scale 'mxfp4'.",
    "scale_rule:uos": "{where}mxfp4_scale_alg=2 (UOS activations, dst_type_max=7.25) is not supported by "
    "{who}: AITER's per-1x32 quantizer has no UOS rule. {alternatives}, or use mxfp4_scale_alg=0.",
    "w4a8": "{where}W4A8 fallback (MXFP8 activations, w4a8_fallback_layers / w4a8_fallback_steps) is not "
    "supported by {who}: AITER's gemm_a4w4 takes FP4 activations only. {alternatives}, or list the layer "
    "in ignored_layers (BF16) instead.",
    "mxfp8": "{where}MXFP8 W8A8 (a layer the checkpoint stores as MXFP8, listed in mxfp8_layers) is not "
    "supported by {who}: this package runs AITER's FP4 GEMM (gemm_a4w4) only. Merge the checkpoint again with "
    "--mxfp8-layers bf16 (those layers in BF16). {alternatives}.",
}


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
        return "aiter_legacy", "aiter.utility.mx_types is absent (AITER before the RoundUp default)"
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
    out = torch.empty((round_up(m, 32), b.shape[0]), dtype=torch.bfloat16, device=a.device)
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


class AiterSingle(MxKernel):
    """Single-scale MXFP4 Linears (online or offline) on gfx950 through AITER."""

    format = "mxfp4"
    backend = "rocm"
    numerics = "rocm"
    a4_rules = ("floor",)
    refusals = AITER_REFUSALS
    alternatives = AITER_ALTERNATIVES
    half_input = "after_smooth"  # AITER quantizes bf16/fp16
    pad_input = True

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
        self.shuffle_weight = importlib.import_module("aiter.ops.shuffle").shuffle_weight
        self.e8m0_shuffle = importlib.import_module("aiter.utility.fp4_utils").e8m0_shuffle
        self.metadata_rule, self.metadata_reason = aiter_rule_from_metadata()
        self._rule: str | None = None

    @classmethod
    def is_supported(cls) -> tuple[bool, str]:
        arch = gpu_arch()
        if arch is None:
            return False, "no ROCm GPU"
        if "gfx950" not in arch:
            return False, f"the ROCm GPU is {arch}, not gfx950 (MI350X/MI355X)"
        if not installed("aiter"):
            return False, "ROCm gfx950 GPU present but AITER is not installed"
        return True, f"AITER is installed and the GPU is {arch}"

    @property
    def who(self) -> str:
        return "the ROCm backend (AITER)"

    def describe(self) -> str:
        rule = self._rule or f"not probed yet; {self.metadata_reason}"
        return f"rocm (AITER on {self.arch}; scale rule {rule})"

    def scale_rule(self, device: torch.device) -> str:
        """The E8M0 rule of the installed AITER's per-1x32 quantizer, probed once on ``device``."""
        if self._rule is not None:
            return self._rule
        probe = torch.zeros(1, MX_BLOCK * len(PROBE_AMAX), dtype=torch.bfloat16, device=device)
        for i, amax in enumerate(PROBE_AMAX):
            probe[0, i * MX_BLOCK] = amax
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
            "weights and activations follow it, not FLOOR; VLLM_OMNI_MXFP4_EMULATED_MIRROR=rocm:%s reproduces it.",
            rule,
            codes,
            self.metadata_reason,
            rule,
        )
        self._rule = rule
        return rule

    def _quantize_weight(self, weight: torch.Tensor, spec: MxLayerSpec) -> dict[str, torch.Tensor]:
        if weight.dtype not in (torch.bfloat16, torch.float16):
            weight = weight.to(torch.bfloat16)  # AITER's HIP quantizer takes bf16/fp16
        self.scale_rule(weight.device)
        k = weight.shape[-1]
        padded = F.pad(weight, (0, round_up(k, MX_BLOCK) - k)).contiguous()
        data, scale = self._quant(padded, shuffle=False)
        data = data.view(torch.uint8)[:, : k // 2].contiguous()
        scale = scale.view(torch.uint8)[:, : ceil_div(k, MX_BLOCK)].contiguous()
        return {"weight": data, "weight_scale": scale}

    def _prepare(self, layer: torch.nn.Module, spec: MxLayerSpec, smooth: torch.Tensor | None) -> Prepared:
        n, k_total = spec.out_features, spec.k_padded
        scale = checked_scale(layer, spec)
        weight = padded_weight(layer, spec)
        self.scale_rule(weight.device)
        k_aligned, n_aligned = round_up(k_total, K_MULTIPLE), round_up(n, N_MULTIPLE)
        weight = F.pad(weight, (0, (k_aligned - k_total) // 2, 0, n_aligned - n)).contiguous()
        scale = F.pad(scale, (0, k_aligned // MX_BLOCK - scale.shape[1], 0, n_aligned - n)).contiguous()
        shuffled = self.shuffle_weight(weight.view(torch.float4_e2m1fn_x2), layout=(16, 16))
        prepared = Prepared(
            spec, smooth, weight=shuffled, scale=self.e8m0_shuffle(scale.view(torch.float8_e8m0fnu))
        )
        if tuple(shuffled.shape) == tuple(layer.weight.shape):
            prepared.adopt_weight(layer, shuffled.view(torch.uint8), unshuffle_weight)
        prepared.k_extra = k_aligned - k_total
        return prepared

    def _matmul(self, x: torch.Tensor, call: Call) -> torch.Tensor:
        prepared = call.prepared
        out = torch.ops.vllm_omni_mxfp4.rocm_mxfp4_gemm(
            x.contiguous(), prepared.weight, prepared.scale, call.spec.out_features
        )
        if call.bias is not None:
            out = out.float() + call.bias.float()
        return out
