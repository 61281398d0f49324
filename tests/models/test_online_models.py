"""Each measured vLLM-Omni diffusion transformer, built tiny and quantized online with ``mxfp4`` and
``mxfp4_dualscale``, tracks its BF16 build, and quantizes exactly what docs/models.md says.

Thresholds. The runs are deterministic (fixed seeds, emulated kernels on the CPU). Measured on tiny
random models of one or two blocks: output cosine 0.9955-0.99998 (Wan2.2 0.9997, as the project's
real Wan2.2 transformer W4A4), Z-Image 0.974-0.979, LingBot-World 0.982; cosine of the quantized Linears' contribution
(output minus the BF16 output with their weights zeroed) 0.936-0.975. The output cosine alone is
blind here: these models pass most of their output through the residual path, and breaking the
quantization on purpose (weights rolled by a third of their rows, a Q/K/V shard-order error) left
HunyuanVideo-1.5 at 0.9997 and Wan2.2 at 0.9917, while their contribution cosine fell to about 0.0
(every model: -0.01 to 0.07). Weights doubled before quantizing (a one-step scale error) moved the
contribution cosine 0.007-0.29 down. So the bars are: output >= 0.99 (lower for the models in
MIN_COSINE_BY_MODEL, each with its reason), contribution >= 0.90 (about 1.5 times the largest
measured distance from 1; Ernie-Image and Krea2 0.85, see MIN_CONTRIBUTION_BY_MODEL), and both within
COSINE_DRIFT of the values the table records, which catches the scale error on every model.

Inputs are built as each model's pipeline builds them (MiniMax-H3's packed sequence, LingBot-World's
KV cache). A case without inputs (``Case.inputs`` None: its forward cannot run quantized, see the
table's notes and test_upstream_forward_gaps.py) is built and loaded with both methods: every
quantized Linear must end prepared and the quantized, BF16 and fused Linears must be the table's.
"""

from __future__ import annotations

import math

import pytest

from tests.support.models import CASES, SPECS, measure, record, table_tool

MIN_COSINE = 0.99
# Z-Image (and Ming's two subclasses of it) and Boogu-Image measured 0.974-0.979. Krea2 quantizes
# every Linear it has, embedders, modulation and final layer included (no BF16 path carries the
# output): 0.882-0.895, and 0.959 when only its transformer blocks are quantized.
MIN_COSINE_BY_MODEL = {
    "z_image.ZImageTransformer2DModel": 0.95,
    "ming_flash_omni.MingZImageTransformer2DModel": 0.95,
    "ming_image.MingImageTransformer2DModel": 0.95,
    "boogu_image.BooguImageTransformer2DModel": 0.95,
    "krea2.Krea2Transformer2DModel": 0.85,
    # measured 0.982-0.983 (contribution 0.967-0.968, in the other models' band)
    "lingbot_world.CausalLingBotWorldTransformer3DModel": 0.97,
    # measured 0.927-0.933: every Linear but the two upstream casts to BF16 quantizes, embedders
    # included (as Krea2)
    "sana_wm.SanaWmTransformer3DModel": 0.90,
}
MIN_CONTRIBUTION = 0.90
# Ernie-Image's tiny build: the quantized Linears add little to the output (output cosine 0.99999),
# so the BF16 rounding of the output itself bounds the contribution cosine (measured 0.882-0.902).
# Krea2: its output is all contribution (see above).
MIN_CONTRIBUTION_BY_MODEL = {
    "ernie_image.ErnieImageTransformer2DModel": 0.85,
    "krea2.Krea2Transformer2DModel": 0.85,
}
# Takes a quant_config but builds every Linear without it (tools/model_table.py's NOTES).
QUANTIZES_NOTHING = {"hidream_image.HiDreamImageTransformer2DModel"}
# the table's cosine is the measurement of the day, not a bound: it may drift this much. CPUs of other
# instruction sets run vLLM's BF16 GEMMs with other kernels: Krea2's mxfp4 cosine is 0.88182 on an
# AVX-512 VM and 0.87888 on an AVX2-only AMD EPYC VM (the same code), so the drift allows 5e-3
COSINE_DRIFT = 5e-3
# and its largest absolute error (one element, in BF16 steps of the output) this fraction of itself
MAX_ABS_DRIFT = 0.25


@pytest.fixture(scope="module")
def measured(vllm_env):
    cache = {}

    def get(key):
        if key not in cache:
            cache[key] = measure(vllm_env, CASES[key])
        return cache[key]

    return get


@pytest.mark.parametrize("key", sorted(CASES))
def test_online_methods_track_bf16(measured, key):
    m = measured(key)
    bar = MIN_COSINE_BY_MODEL.get(key, MIN_COSINE)
    for method in SPECS:
        assert not m.unprepared[method], f"{key} {method}: loaded but not prepared: {m.unprepared[method]}"
        if key in QUANTIZES_NOTHING:
            assert not m.quantized[method] and m.unquantized, (key, m.quantized[method], m.unquantized)
            # the method's config changes nothing: the same output, bit for bit
            assert m.max_abs[method] == 0.0 and not m.contribution, (key, method, m.max_abs, m.contribution)
            continue
        assert m.quantized[method], f"{key}: {method} quantized no Linear"
        if CASES[key].inputs is None:
            continue  # built and loaded only: the table's NOTES say why its forward is not run
        assert math.isfinite(m.max_abs[method]) and m.max_abs[method] > 0, (key, method, m.max_abs)
        assert m.cosine[method] >= bar, f"{key} {method}: cosine {m.cosine[method]:.5f} < {bar}"
        floor = MIN_CONTRIBUTION_BY_MODEL.get(key, MIN_CONTRIBUTION)
        assert m.contribution[method] >= floor, (
            f"{key} {method}: cosine of the quantized Linears' contribution "
            f"{m.contribution[method]:.4f} < {floor}"
        )


@pytest.mark.parametrize("key", sorted(CASES))
def test_table_records_what_the_model_quantizes(measured, key, recorded_models):
    got = record(measured(key))
    if recorded_models is not None:
        recorded_models[key] = got
        return
    want = table_tool().MEASURED.get(key)
    hint = (
        f"{key} measures {got!r}: if that is intended, record it (pytest tests/models --record-models) and "
        "regenerate docs/models.md (python tools/model_table.py)"
    )
    assert want is not None, hint
    assert got["quantized"] == want["quantized"], hint
    assert {k: got[k] for k in ("plain", "unquantized", "fused", "packed")} == {
        k: want[k] for k in ("plain", "unquantized", "fused", "packed")
    }, hint
    for kind in ("cosine", "contribution"):
        assert set(got[kind]) == set(want[kind]), hint
        for method in got[kind]:
            assert abs(got[kind][method] - want[kind][method]) <= COSINE_DRIFT, f"{kind}: {hint}"
    assert set(got["max_abs"]) == set(want["max_abs"]), hint
    for method, value in got["max_abs"].items():
        assert abs(value - want["max_abs"][method]) <= MAX_ABS_DRIFT * want["max_abs"][method], (
            f"max_abs: {hint}"
        )


def test_every_measured_model_is_a_case():
    """The table lists no measurement this suite does not repeat."""
    assert set(table_tool().MEASURED) == set(CASES)
