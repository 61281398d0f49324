"""Each measured vLLM-Omni diffusion transformer, built tiny and quantized online with ``mxfp4`` and
``mxfp4_dualscale``, tracks its BF16 build, and quantizes exactly what docs/models.md says.

Thresholds. The runs are deterministic (fixed seeds, emulated kernels on the CPU), so the margin
only has to absorb library-version drift in BF16 arithmetic. Measured (tiny random models, one or
two blocks): Wan2.2 0.9997 (the project's real Wan2.2 transformer: 0.9997 W4A4), the others
0.9955-0.99998, Z-Image 0.974-0.979. The bar is 0.99 (at least twice each model's measured distance
from 1) and 0.95 for Z-Image; a broken quantization path (wrong scale, shard order or K layout)
lands far below either.
"""

from __future__ import annotations

import math

import pytest

from tests.support.models import CASES, SPECS, measure, record, table_tool

MIN_COSINE = 0.99
MIN_COSINE_BY_MODEL = {"z_image.ZImageTransformer2DModel": 0.95}
# the table's cosine is the measurement of the day, not a bound: it may drift this much
COSINE_DRIFT = 2e-3


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
        assert m.quantized[method], f"{key}: {method} quantized no Linear"
        assert math.isfinite(m.max_abs[method]) and m.max_abs[method] > 0, (key, method, m.max_abs)
        assert m.cosine[method] >= bar, f"{key} {method}: cosine {m.cosine[method]:.5f} < {bar}"


@pytest.mark.parametrize("key", sorted(CASES))
def test_table_records_what_the_model_quantizes(measured, key):
    got = record(measured(key))
    want = table_tool().MEASURED.get(key)
    hint = f"update MEASURED[{key!r}] in tools/model_table.py to {got!r} and regenerate docs/models.md"
    assert want is not None, hint
    assert got["quantized"] == want["quantized"], hint
    assert {k: got[k] for k in ("plain", "unquantized", "fused", "packed")} == {
        k: want[k] for k in ("plain", "unquantized", "fused", "packed")
    }, hint
    for method in SPECS:
        assert abs(got["cosine"][method] - want["cosine"][method]) <= COSINE_DRIFT, hint


def test_every_measured_model_is_a_case():
    """The table lists no measurement this suite does not repeat."""
    assert set(table_tool().MEASURED) == set(CASES)
