"""Golden UOS (NPU ``scale_alg=2``, ``dst_type_max=7.25``) scale codes at the two edges the block
table of test_mx.py does not reach: float32-subnormal ``S = amax * fp32(1/7.25)``, and fp16 inputs,
whose block maximum the NPU takes as a bf16 value (round to nearest, ties to even) first.

Each literal is checked against ``formats`` and the independent reference (tests/formats/reference.py).
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni_mxfp4.formats import dequantize_mx, quantize_mx

from . import reference as ref

# amax -> (UOS code, RCEIL code). S = amax / 7.25 below 2^-126 is a float32 subnormal: UOS takes its
# biased exponent 0 and never rounds a subnormal up, where RCEIL (amax / 6) rounds one up when its
# mantissa exceeds one half.
SUBNORMAL = {
    2.0**-130: (0, 0),  # the input itself is subnormal
    2.0**-126: (0, 0),
    2.0**-124: (0, 1),  # S ~ 0.55 * 2^-126: UOS keeps 0, RCEIL rounds up
    7.25 * 2.0**-127: (0, 1),
    7.25 * 2.0**-126: (1, 2),  # S just reaches the normal range: biased exponent 1
    7.25 * 2.0**-125: (2, 3),
    2.0**-100: (25, 25),
}

# fp16 amax -> (UOS code of the fp16 input, of the same value in float32, the bf16 value the NPU sees)
FP16_AMAX = {
    3.626953125: (126, 127, 3.625),  # rounds down to 3.625 = 7.25 / 2: one code lower
    3.6328125: (126, 127, 3.625),  # exactly halfway: ties to the even bf16 (3.625), not up
    3.634765625: (127, 127, 3.640625),  # above halfway: up, the code is unchanged
    7.2578125: (127, 128, 7.25),  # just above 7.25: rounded back onto it
}


def _block(amax: float, dtype: torch.dtype) -> torch.Tensor:
    row = torch.zeros(1, 32)
    row[0, 3] = amax
    row[0, 9] = -amax / 4  # smaller elements must not matter
    x = row.to(dtype)
    assert x[0, 3].item() == amax  # the literal is exact in the input dtype
    return x


@pytest.mark.parametrize("amax", sorted(SUBNORMAL))
def test_uos_codes_of_subnormal_scales(amax):
    uos, rceil = SUBNORMAL[amax]
    x = _block(amax, torch.float32)
    data, scale = quantize_mx(x, scale_rule="uos")
    assert scale.item() == uos == ref.scale_code(amax, "uos")
    assert quantize_mx(x, scale_rule="rceil")[1].item() == rceil == ref.scale_code(amax, "rceil")
    codes, scales = ref.quantize_row(x[0].tolist(), "uos")
    assert scales == [uos] and torch.equal(dequantize_mx(data, scale)[0], _values(codes, uos))


@pytest.mark.parametrize("amax", sorted(FP16_AMAX))
def test_uos_rounds_fp16_block_maxima_to_bf16(amax):
    fp16_code, fp32_code, seen = FP16_AMAX[amax]
    assert ref.bf16_round(amax) == seen == torch.tensor(amax).to(torch.bfloat16).item()
    x16 = _block(amax, torch.float16)
    data, scale = quantize_mx(x16, scale_rule="uos")
    assert scale.item() == fp16_code == ref.scale_code(seen, "uos")
    assert quantize_mx(_block(amax, torch.float32), scale_rule="uos")[1].item() == fp32_code
    codes, scales = ref.quantize_row(x16[0].float().tolist(), "uos", amax_bf16=True)
    assert scales == [fp16_code] and torch.equal(dequantize_mx(data, scale)[0], _values(codes, fp16_code))
    # Only UOS looks at the rounded maximum: FLOOR sees the fp16 value's own exponent.
    assert quantize_mx(x16, scale_rule="floor")[1].item() == ref.scale_code(amax, "floor")


def _values(codes: list[int], scale_code: int) -> torch.Tensor:
    return torch.tensor([ref.CODE_VALUES[c] * 2.0 ** (scale_code - 127) for c in codes])
