"""A semantic fake of the AITER pieces the ROCm kernel calls, built on the project's formats core.

Modules: ``aiter`` (``QuantType``, ``get_hip_quant``, ``gemm_a4w4``), ``aiter.ops.shuffle``
(``shuffle_weight``, ``shuffle_scale``), ``aiter.utility.fp4_utils`` (``e8m0_shuffle``) and, for
AITER from 2026-06 on, ``aiter.utility.mx_types`` (``MX_DEFAULT_ROUND_MODE``). What each checks and
computes (docs/kernels.md, AITER's own source):

- ``get_hip_quant(QuantType.per_1x32)(x, shuffle=...)``: a contiguous 2-D bf16/fp16 ``x`` with
  ``n % 32 == 0``; FP4 E2M1 with the E8M0 rule of the AITER version being faked (``rceil`` or
  ``aiter_legacy``), elements RNE; returns ``float4_e2m1fn_x2`` (m, n/2) and ``float8_e8m0fnu``
  scales (m, n/32), or with ``shuffle=True`` padded to (256, 8) multiples and shuffled. Padding is
  filled with 0xFF (AITER leaves it uninitialised: nothing may read it).
- ``shuffle_weight(w, layout=(16, 16))``: packed bytes (N % 16, (K/2) % 32), the (16, 16) tile
  permutation, same dtype, tagged ``is_shuffled = True``.
- ``shuffle_scale`` / ``e8m0_shuffle``: pad to (256, 8) multiples (0xFF), then AITER's scale
  permutation; float32 scales are returned untouched, as AITER does.
- ``gemm_a4w4`` (the asm kernel, ``csrc/py_itfs_cu/asm_gemm_a4w4.cu``): A (M, K/2)
  ``float4_e2m1fn_x2`` (its config lookup refuses uint8 activations when torch has fp4x2), B
  (N, K/2) packed FP4 tagged ``is_shuffled`` with ``bpreshuffle=True``; N a multiple of
  :data:`ASM_TILE_N` (the kernels exist only for N a multiple of their tile width); bf16 output
  only; no bias (the asm kernel takes it as C with ``beta = 0`` and drops it, so passing one is an
  error here); A_scale and B_scale ``float8_e8m0fnu`` in the padded shuffled layout
  ((roundup(M, 256), roundup(K/32, 8)) and (roundup(N, 256), ...)); the result is the dequantized
  operands multiplied in float32, in bf16. ``gemm_api="out"`` fakes the older signature that
  writes a preallocated bf16 ``out`` with rows padded to 32.
"""

from __future__ import annotations

import enum
import types

import torch
import torch.nn.functional as F

from vllm_omni_mxfp4.formats import MX_BLOCK_SIZE, dequantize_mx, quantize_mx

FP4X2 = torch.float4_e2m1fn_x2
E8M0 = torch.float8_e8m0fnu
POISON = 0xFF
#: N must be a multiple of this for the asm gemm_a4w4 to find a kernel: its tile widths are 128 or
#: 256 by config, and only a multiple of 256 is certain to match one in every build.
ASM_TILE_N = 256


class FakeAiterError(ValueError):
    """A call the real AITER would reject (or compute something else for)."""


class QuantType(enum.Enum):
    No = 0
    per_Tensor = 1
    per_Token = 2
    per_1x32 = 3
    per_1x128 = 4


class MxScaleRoundMode(enum.IntEnum):
    RoundUp = 0
    RoundDown = 1
    Ceil = 2
    Even = 3


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def shuffle_scale_layout(codes: torch.Tensor) -> torch.Tensor:
    """AITER's E8M0 scale shuffle of uint8 (m, n): pad to (256, 8) multiples, permute."""
    m, n = codes.shape
    sm, sn = _round_up(m, 256), _round_up(n, 8)
    padded = torch.full((sm, sn), POISON, dtype=torch.uint8, device=codes.device)
    padded[:m, :n] = codes
    return padded.view(sm // 32, 2, 16, sn // 8, 2, 4).permute(0, 3, 5, 2, 4, 1).contiguous().view(sm, sn)


def unshuffle_scale_layout(shuffled: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Inverse of :func:`shuffle_scale_layout`, cut to (m, n)."""
    sm, sn = shuffled.shape
    plain = shuffled.reshape(sm // 32, sn // 8, 4, 16, 2, 2).permute(0, 5, 3, 1, 4, 2).reshape(sm, sn)
    return plain[:m, :n]


def unshuffle_weight_layout(shuffled: torch.Tensor) -> torch.Tensor:
    n, kb = shuffled.shape
    return shuffled.reshape(n // 16, kb // 32, 2, 16, 16).permute(0, 3, 1, 2, 4).reshape(n, kb)


def _bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype == FP4X2:
        return t.view(torch.uint8)
    if t.dtype != torch.uint8:
        raise FakeAiterError(f"{name}: packed FP4 must be float4_e2m1fn_x2 or uint8, got {t.dtype}")
    return t


def _e8m0_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype != E8M0:
        raise FakeAiterError(
            f"{name}: scales must be float8_e8m0fnu (AITER's dtypes.fp8_e8m0), got {t.dtype}"
        )
    return t.view(torch.uint8)


class FakeAiter:
    """The fake modules of one AITER version; ``install(monkeypatch)`` puts them into sys.modules."""

    def __init__(
        self, rule: str = "rceil", *, gemm_api: str = "dtype", metadata: str | None = "auto"
    ) -> None:
        if rule not in ("rceil", "aiter_legacy"):
            raise ValueError(
                f"fake AITER versions use rule 'rceil' (2026-06 on) or 'aiter_legacy', not {rule!r}"
            )
        self.rule = rule
        self.gemm_api = gemm_api
        self.calls: list[tuple[str, tuple, dict]] = []
        aiter = types.ModuleType("aiter")
        aiter.__path__ = []
        aiter.__version__ = f"fake-{rule}"
        aiter.QuantType = QuantType
        aiter.get_hip_quant = self.get_hip_quant
        aiter.gemm_a4w4 = self.gemm_a4w4 if gemm_api == "dtype" else self.gemm_a4w4_out
        ops = types.ModuleType("aiter.ops")
        ops.__path__ = []
        shuffle = types.ModuleType("aiter.ops.shuffle")
        shuffle.shuffle_weight = self.shuffle_weight
        shuffle.shuffle_scale = self.shuffle_scale
        utility = types.ModuleType("aiter.utility")
        utility.__path__ = []
        fp4_utils = types.ModuleType("aiter.utility.fp4_utils")
        fp4_utils.e8m0_shuffle = self.shuffle_scale
        aiter.ops, ops.shuffle, aiter.utility, utility.fp4_utils = ops, shuffle, utility, fp4_utils
        self.modules = {
            "aiter": aiter,
            "aiter.ops": ops,
            "aiter.ops.shuffle": shuffle,
            "aiter.utility": utility,
            "aiter.utility.fp4_utils": fp4_utils,
        }
        if metadata == "auto":
            metadata = "RoundUp" if rule == "rceil" else None
        if metadata is not None:
            mx_types = types.ModuleType("aiter.utility.mx_types")
            mx_types.MxScaleRoundMode = MxScaleRoundMode
            mx_types.MX_DEFAULT_ROUND_MODE = MxScaleRoundMode[metadata]
            utility.mx_types = mx_types
            self.modules["aiter.utility.mx_types"] = mx_types

    @property
    def aiter(self) -> types.ModuleType:
        return self.modules["aiter"]

    def install(self, monkeypatch) -> FakeAiter:
        import sys

        for name in [m for m in sys.modules if m == "aiter" or m.startswith("aiter.")]:
            monkeypatch.delitem(sys.modules, name)
        for name, module in self.modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        return self

    # ------------------------------------------------------------------ ops

    def get_hip_quant(self, qtype):
        if qtype is not QuantType.per_1x32:
            raise NotImplementedError(f"fake get_hip_quant models QuantType.per_1x32 only, not {qtype}")
        return self.per_1x32_quant

    def per_1x32_quant(
        self, x, scale=None, quant_dtype=FP4X2, shuffle=False, num_rows=None, num_rows_factor=1
    ):
        self.calls.append(("per_1x32_quant", (x,), {"shuffle": shuffle}))
        if scale is not None:
            raise FakeAiterError("per_1x32 quant: static scales are unsupported (scale must be None)")
        if quant_dtype is not FP4X2:
            raise NotImplementedError("fake per_1x32 quant models FP4 (dtypes.fp4x2) output only")
        if x.dim() != 2 or not x.is_contiguous():
            raise FakeAiterError(
                f"per_1x32 quant: x must be a contiguous 2-D (m, n) tensor, got {tuple(x.shape)}"
            )
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise FakeAiterError(f"per_1x32 quant: x must be bf16/fp16, got {x.dtype}")
        if x.shape[1] % 32:
            raise FakeAiterError(f"per_1x32 quant: n={x.shape[1]} must be divisible by 32")
        data, codes = quantize_mx(x, elem="fp4", scale_rule=self.rule)
        if shuffle:
            codes = shuffle_scale_layout(codes)
        return data.view(FP4X2), codes.view(E8M0)

    def shuffle_weight(self, x, layout=(16, 16), use_int4=False, is_guinterleave=False, gate_up=False):
        self.calls.append(("shuffle_weight", (x,), {"layout": layout}))
        if tuple(layout) != (16, 16) or use_int4 or is_guinterleave or gate_up:
            raise NotImplementedError("fake shuffle_weight models layout=(16, 16) on packed FP4 bytes only")
        raw = _bytes(x, "shuffle_weight(x)")
        n, kb = raw.shape
        if n % 16 or kb % 32:
            raise FakeAiterError(
                f"shuffle_weight: needs N % 16 == 0 and K/2 % 32 == 0, got {tuple(raw.shape)}"
            )
        out = raw.reshape(n // 16, 16, kb // 32, 2, 16).permute(0, 2, 3, 1, 4).contiguous().view(n, kb)
        out = out.view(x.dtype)
        out.is_shuffled = True
        return out

    def shuffle_scale(self, src):
        self.calls.append(("shuffle_scale", (src,), {}))
        if src is None or src.dtype == torch.float32:
            return src
        if src.dim() != 2:
            raise FakeAiterError("shuffle_scale: scale must be a 2D tensor")
        raw = src.view(torch.uint8)
        return shuffle_scale_layout(raw).view(src.dtype)

    def _check_and_compute(self, A, B, A_scale, B_scale, bias, bpreshuffle) -> torch.Tensor:
        if A.dtype != FP4X2:
            raise FakeAiterError(f"gemm_a4w4: Unsupported input_type: {A.dtype} (A must be float4_e2m1fn_x2)")
        a = _bytes(A, "gemm_a4w4(A)")
        b = _bytes(B, "gemm_a4w4(B)")
        if a.dim() != 2 or b.dim() != 2 or not a.is_contiguous() or not b.is_contiguous():
            raise FakeAiterError("gemm_a4w4: A (M, K/2) and B (N, K/2) must be contiguous 2-D")
        (m, kb), n = a.shape, b.shape[0]
        if b.shape[1] != kb:
            raise FakeAiterError(f"gemm_a4w4: A has K/2={kb} but B has {b.shape[1]}")
        if n % ASM_TILE_N:
            raise FakeAiterError(
                f"gemm_a4w4: cannot get heuristic kernel! N={n} is not a multiple of the asm tile width "
                f"{ASM_TILE_N}"
            )
        if bias is not None:
            raise FakeAiterError(
                "gemm_a4w4: the asm kernel takes bias as C with beta=0 and drops it; add it after the GEMM"
            )
        if not bpreshuffle:
            raise NotImplementedError("fake gemm_a4w4 models the preshuffled-B kernels (bpreshuffle=True)")
        if not getattr(B, "is_shuffled", False):
            raise FakeAiterError(
                "gemm_a4w4: bpreshuffle=True needs B from shuffle_weight(w, layout=(16, 16))"
            )
        groups = kb * 2 // MX_BLOCK_SIZE
        a_s, b_s = _e8m0_bytes(A_scale, "gemm_a4w4(A_scale)"), _e8m0_bytes(B_scale, "gemm_a4w4(B_scale)")
        for name, s, rows in (("A_scale", a_s, m), ("B_scale", b_s, n)):
            want = (_round_up(rows, 256), _round_up(groups, 8))
            if tuple(s.shape) != want:
                raise FakeAiterError(
                    f"gemm_a4w4: {name} must be the padded shuffled E8M0 layout {want} (e8m0_shuffle / quant with "
                    f"shuffle=True), got {tuple(s.shape)}"
                )
        a_codes = unshuffle_scale_layout(a_s, m, groups)
        b_codes = unshuffle_scale_layout(b_s, n, groups)
        a_deq = dequantize_mx(a, a_codes, dtype=torch.float32)
        b_deq = dequantize_mx(unshuffle_weight_layout(b), b_codes, dtype=torch.float32)
        return F.linear(a_deq, b_deq)

    def gemm_a4w4(
        self,
        A,
        B,
        A_scale,
        B_scale,
        bias=None,
        dtype=torch.bfloat16,
        alpha=1.0,
        beta=0.0,
        bpreshuffle=True,
        apreshuffle=False,
        global_A_scale=None,
        global_B_scale=None,
    ):
        self.calls.append(
            (
                "gemm_a4w4",
                (A, B, A_scale, B_scale),
                {"bias": bias, "dtype": dtype, "bpreshuffle": bpreshuffle},
            )
        )
        if apreshuffle or global_A_scale is not None or global_B_scale is not None:
            raise NotImplementedError(
                "fake gemm_a4w4 models MXFP4 with plain A (no NVFP4 globals, apreshuffle)"
            )
        if alpha != 1.0 or beta != 0.0:
            raise NotImplementedError("fake gemm_a4w4 models alpha=1, beta=0")
        if dtype != torch.bfloat16:
            raise FakeAiterError(f"gemm_a4w4: only support BFloat16 output now! (dtype={dtype})")
        return self._check_and_compute(A, B, A_scale, B_scale, bias, bpreshuffle).to(dtype)

    def gemm_a4w4_out(self, A, B, A_scale, B_scale, out, bias=None, alpha=1.0, beta=0.0, bpreshuffle=True):
        self.calls.append(
            ("gemm_a4w4", (A, B, A_scale, B_scale, out), {"bias": bias, "bpreshuffle": bpreshuffle})
        )
        m, n = A.shape[0], B.shape[0]
        if out.dtype != torch.bfloat16 or tuple(out.shape) != (_round_up(m, 32), n):
            raise FakeAiterError(
                f"gemm_a4w4: out must be bf16 ({_round_up(m, 32)}, {n}) (rows padded to 32), got "
                f"{out.dtype} {tuple(out.shape)}"
            )
        out[:m] = self._check_and_compute(A, B, A_scale, B_scale, bias, bpreshuffle).to(out.dtype)
        return out
