"""End to end through ``Omni(...)`` on the tiny pipelines of every model family
(:mod:`vllm_omni_mxfp4_demo.models`), and the checks of its results table.

The engine tests run each family's tiny pipeline in BF16 and with one online method through the
shared runner (two engine processes per family; the families alternate between ``mxfp4`` and
``mxfp4_dualscale`` so both run end to end while the suite stays within its time budget; the full
three-mode table is ``docs/models_e2e.json``, written by ``python -m vllm_omni_mxfp4_demo.models``).
Each asserts that the quantized engine really ran the method on the Linears vLLM-Omni builds with a
quantization config (read from the running engine's report), that its output differs from BF16
(quantization did something), and that PSNR and cosine stay above bars measured on this CPU
platform with a margin (see :data:`BARS`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.platform.omni_procs import omni_installed, subprocess_env
from vllm_omni_mxfp4_demo import models
from vllm_omni_mxfp4_demo.modes import MODES

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "models_e2e.json"
MODE = {m.name: m for m in MODES}
FAMILY = {f.key: f for f in models.FAMILIES}
METHOD = {"mxfp4": "mxfp4", "dualscale": "mxfp4_dualscale"}


# ----------------------------------------------------------------------------- without an engine


def test_every_family_is_runnable_or_says_why():
    assert set(models.FAMILY_KEYS) >= {
        "wan22_t2v_a14b",
        "wan22_i2v_a14b",
        "wan22_ti2v_5b",
        "qwen_image",
        "flux1_dev",
        "flux2_klein",
        "hunyuan_video_15",
        "z_image",
    }
    assert [f.key for f in models.FAMILIES if f.unsupported is not None] == []
    assert all(callable(family.build) for family in models.FAMILIES)


def test_input_image_is_deterministic(tmp_path):
    from PIL import Image

    first = np.asarray(Image.open(models.input_image(tmp_path / "a.png", 32, 48)))
    second = np.asarray(Image.open(models.input_image(tmp_path / "b.png", 32, 48)))
    assert first.shape == (32, 48, 3) and first.dtype == np.uint8
    assert np.array_equal(first, second)
    assert first[0, 0].tolist() == [0, 0, 0] and first[31, 47].tolist() == [255, 255, 78]


def test_linear_methods_count_each_transformer():
    result = {
        "transformers": [
            {
                "name": "transformer",
                "linears": [{"method": "bf16"}, {"method": "mxfp4"}, {"method": "mxfp4"}],
            },
            {"name": "transformer_2", "linears": [{"method": "bf16"}]},
        ]
    }
    assert models.linear_methods(result) == {
        "transformer": {"bf16": 1, "mxfp4": 2},
        "transformer_2": {"bf16": 1},
    }
    assert models.linear_methods({}) == {}


def test_unknown_family_or_mode_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        models.main(["--families", "flux1_dev,flux3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--families: unknown ['flux3']" in err and "flux1_dev" in err
    with pytest.raises(SystemExit):
        models.main(["--modes", "mxfp5"])
    assert "--modes: unknown ['mxfp5']" in capsys.readouterr().err


def test_unsupported_family_is_listed_with_its_reason(tmp_path, capsys, monkeypatch):
    """A family that cannot run carries its reason into the table, and no engine starts for it."""
    why = "its pipeline cannot be built from a tiny config"
    family = dataclasses.replace(FAMILY["z_image"], build=None, unsupported=why)
    monkeypatch.setattr(models, "FAMILIES", (family,))
    out = tmp_path / "out"
    assert models.main(["--families", "z_image", "--out", str(out)]) == 0
    table = json.loads((out / "models_e2e.json").read_text())
    assert table["families"] == {"z_image": {"title": "Z-Image", "unsupported": why}}
    assert f"Z-Image            not run: {why}" in capsys.readouterr().out


def test_results_table_covers_every_family():
    """docs/models_e2e.json (the runner's output the docs and the model table read) has a record
    of all three modes for every runnable family, and the reason for the others."""
    table = json.loads(RESULTS.read_text())
    assert list(table["families"]) == list(models.FAMILY_KEYS)
    for family in models.FAMILIES:
        record = table["families"][family.key]
        if family.unsupported is not None:
            assert record["unsupported"] == family.unsupported
            continue
        assert list(record["modes"]) == ["bf16", "mxfp4", "dualscale"], family.key
        assert record["modes"]["bf16"]["psnr_db"] == "inf"
        for name, method in METHOD.items():
            mode = record["modes"][name]
            assert math.isfinite(mode["psnr_db"]) and 0.0 < mode["cosine"] < 1.0, (family.key, name)
            assert all(counts.get(method, 0) > 0 for counts in mode["linears"].values()), (family.key, name)


def test_docs_show_the_results_table():
    """docs/e2e_models.md's table is what the runner prints for docs/models_e2e.json."""
    table = json.loads(RESULTS.read_text())
    text = (ROOT / "docs" / "e2e_models.md").read_text()
    assert f"```text\n{models.format_table(table['families'])}\n```" in text
    assert table["generated_by"] in text


# ----------------------------------------------------------------------------- through the engine

# family -> (the mode its test runs, PSNR bar in dB, cosine bar, Linears per transformer that run the
# mode's method). The bars are the docs/models_e2e.json measurement on the CPU platform with a margin:
# 3 dB below its PSNR, and twice its distance from cosine 1 (0.9997 -> 0.9994). Wan2.2 T2V-A14B is
# not repeated here: tests/omni/test_omni_e2e.py runs it through Omni(...) with both methods.
ENGINE_CASES = {
    "wan22_i2v_a14b": ("dualscale", 49.0, 0.9995, {"transformer": 16, "transformer_2": 16}),
    "wan22_ti2v_5b": ("mxfp4", 47.0, 0.9996, {"transformer": 16}),
    "qwen_image": ("dualscale", 54.0, 0.9994, {"transformer": 14}),
    "flux1_dev": ("mxfp4", 46.0, 0.9997, {"transformer": 3}),
    "flux2_klein": ("dualscale", 43.0, 0.9989, {"transformer": 10}),
    "hunyuan_video_15": ("mxfp4", 47.0, 0.9998, {"transformer": 8}),
    # 31.1 dB / 0.98535: the tiny transformer alone is at 0.979 (docs/models.md); its Qwen3 text
    # encoder stays BF16 (vllm_omni_mxfp4/omni/text_encoders.py)
    "z_image": ("mxfp4", 28.0, 0.970, {"transformer": 12}),
}


@pytest.mark.slow
@pytest.mark.omni
@pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed")
@pytest.mark.parametrize("key", list(ENGINE_CASES))
def test_family_end_to_end(key, tmp_path):
    mode_name, psnr_bar, cosine_bar, quantized = ENGINE_CASES[key]
    modes = [MODE["bf16"], MODE[mode_name]]
    record = models.run_family(FAMILY[key], tmp_path, modes, steps=2, timeout=600, env=subprocess_env())
    bf16, quant = record["modes"]["bf16"], record["modes"][mode_name]
    assert all(set(counts) == {"bf16"} for counts in bf16["linears"].values()), bf16["linears"]
    method = METHOD[mode_name]
    assert {name: counts.get(method, 0) for name, counts in quant["linears"].items()} == quantized
    # quantization changed the output (a silent BF16 fallback would give inf), and not by much
    assert isinstance(quant["psnr_db"], float) and psnr_bar <= quant["psnr_db"], quant
    assert cosine_bar <= quant["cosine"] < 1.0, quant
