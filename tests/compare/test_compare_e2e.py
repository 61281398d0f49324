"""``vllm-omni-mxfp4 compare`` end to end: the real engine on the tiny Wan2.2, one engine per config.

One run compares BF16 with ``mxfp4`` given twice under two labels (the engine, the step recording
and the measures must give both the same numbers), and W4A8 on every step. The run is shared by the
tests of this module.
"""

from __future__ import annotations

import json
import math

import pytest
from PIL import Image

from tests.platform.omni_procs import omni_installed, run_bounded, subprocess_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]

STEPS = 3
W4A8 = '{"method": "mxfp4", "w4a8_fallback_steps": [0, 1, 2]}'


@pytest.fixture(scope="module")
def compared(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "out"
    argv = ["-m", "vllm_omni_mxfp4.cli", "compare", str(tiny_dir), "--prompt", "a cat walking on the grass"]
    argv += ["--config", "a=mxfp4", "--config", "b=mxfp4", "--config", f"w4a8={W4A8}"]
    argv += ["--steps", str(STEPS), "--height", "32", "--width", "32", "--num-frames", "5", "--out", str(out)]
    log = out.parent / "compare.log"
    run_bounded(argv, timeout=900, env=subprocess_env(), log=log)
    return out, log.read_text(), json.loads((out / "compare.json").read_text())


def test_every_config_has_a_measure_per_step_and_final_measures(compared):
    _, text, result = compared
    configs = {c["label"]: c for c in result["configs"]}
    assert list(configs) == ["bf16", "a", "b", "w4a8"]
    bf16 = configs["bf16"]
    assert (
        bf16["reference"] and bf16["final"]["psnr"] == "inf" and bf16["final"]["ssim"] == pytest.approx(1.0)
    )
    for label in ("a", "w4a8"):
        steps = configs[label]["steps"]
        assert [s["step"] for s in steps] == list(range(STEPS))
        assert all(0.5 < s["cosine"] < 1.0 and s["mse"] > 0 for s in steps), steps
        final = configs[label]["final"]
        assert 10 < final["psnr"] < math.inf and 0 < final["ssim"] < 1 and 0 < final["cosine"] < 1
    assert configs["a"]["prompt_accuracy"] is None  # no task metric knows the random tiny model
    assert configs["a"]["omni_kwargs"] == {"quantization": "mxfp4"}
    assert configs["w4a8"]["omni_kwargs"] == {"quantization_config": json.loads(W4A8)}
    assert "PSNR dB" in text and "compare.json" in text


def test_the_same_config_twice_gives_the_same_numbers(compared):
    """Engines, step recording and measures are deterministic: labels a and b ran the same config."""
    _, _, result = compared
    configs = {c["label"]: c for c in result["configs"]}
    a, b = configs["a"], configs["b"]
    assert a["steps"] == b["steps"] and a["final"] == b["final"] and a["weight_bytes"] == b["weight_bytes"]
    assert a["steps"] != configs["w4a8"]["steps"]  # the W4A8 steps ran differently


def test_weights_and_picture(compared):
    out, _, result = compared
    configs = {c["label"]: c for c in result["configs"]}
    assert configs["a"]["weight_bytes"] < 0.6 * configs["bf16"]["weight_bytes"]
    assert all(c["seconds"] > 0 and c["start_seconds"] > 0 for c in configs.values())
    with Image.open(out / "compare.png") as png:
        assert png.size[0] >= 640 and png.size[1] > 260 + 4 * 96  # the chart, then a strip per config
