"""``vllm-omni-mxfp4 tune`` on every model family that runs end to end (``docs/e2e_models.md``).

Each family's tiny random pipeline (built as :mod:`vllm_omni_mxfp4_demo.models` builds it, from the
same cache) is tuned with the smallest budget and one candidate: 4 passes of 1 generation of 2 steps.
The Linears tune scores must be exactly the ones the running engine quantizes with that method (the
counts per component the family's end-to-end record holds, ``docs/models_e2e.json``, read from the
live engine there), the config it writes must parse and name only those Linears, and the cost line
must say what ran. The families alternate between ``mxfp4`` and ``mxfp4_dualscale`` (a BF16 budget
only: DualScale has no W4A8), as the end-to-end tests do. Wan2.2 T2V is covered by
``tests/tune/test_tune_e2e.py``.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import pytest

from tests.platform.omni_procs import omni_installed, run_bounded, subprocess_env
from vllm_omni_mxfp4.config import parse_quantization
from vllm_omni_mxfp4_demo import models

pytestmark = [
    pytest.mark.slow,
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]

ROOT = Path(__file__).resolve().parents[2]
RECORDS = json.loads((ROOT / "docs" / "models_e2e.json").read_text())["families"]
FAMILIES = [f for f in models.FAMILIES if f.unsupported is None and f.key != "wan22_t2v_a14b"]
METHOD = {f.key: ("mxfp4", "mxfp4_dualscale")[i % 2] for i, f in enumerate(FAMILIES)}
MODE = {"mxfp4": "mxfp4", "mxfp4_dualscale": "dualscale"}


@pytest.mark.parametrize("family", FAMILIES, ids=[f.key for f in FAMILIES])
def test_tune_scores_the_linears_the_engine_quantizes(family, tmp_path: Path):
    method = METHOD[family.key]
    argv = ["-m", "vllm_omni_mxfp4.cli", "tune", str(family.build()), "--method", method]
    argv += ["--prompt", models.PROMPT, "--seed", str(models.SEED), "--steps", "2"]
    argv += [
        "--height",
        str(family.height),
        "--width",
        str(family.width),
        "--guidance-scale",
        str(family.guidance_scale),
    ]
    if family.num_frames > 1:
        argv += ["--num-frames", str(family.num_frames)]
    if family.image:
        argv += ["--image", str(models.input_image(tmp_path / "input.png", family.height, family.width))]
    argv += ["--max-bf16-layers", "1", "--candidates", "1", "--out", str(tmp_path / "out")]
    log = tmp_path / "tune.log"
    run_bounded(argv, timeout=900, env=subprocess_env(), log=log)
    with open(tmp_path / "out" / "scores.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    record = RECORDS[family.key]["modes"][MODE[method]]["linears"]
    expected = {component: counts[method] for component, counts in record.items() if counts.get(method)}
    assert Counter(r["component"] for r in rows) == expected
    assert all(float(r["local_rel_error_w4a4"]) > 0 for r in rows)  # every Linear ran and was scored
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    parse_quantization(config)
    per = config if "method" not in config else {component: config for component in expected}
    names = {(r["component"], r["layer"]) for r in rows}
    chosen = [(c, layer) for c, entry in per.items() for layer in entry["ignored_layers"]]
    kept_by_default = [(c, layer) for c, layer in chosen if (c, layer) not in names]
    assert len(chosen) - len(kept_by_default) <= 1  # the budget
    assert all(r["chosen"] in ("bf16", "w4a4") for r in rows)  # no W4A8 budget given
    assert "cost: 4 passes (candidates + 3) x 1 tuning request(s) = 4 generations" in log.read_text()
