"""``vllm-omni-mxfp4 tune`` end to end on the tiny random Wan2.2 with one Linear made sensitive.

The checkpoint is edited by a function-preserving rescaling (:func:`plant`): in the high-noise
expert's block 1, one value-projection channel of every 32 is multiplied by 2^10 and the matching
input columns of the attention output projection by 2^-10. The BF16 function does not change (powers
of two, exact in BF16; checked on diffusers' own transformer), but every MX block of
``attn1.to_out``'s input now holds an outlier 1024 times the other channels, so MXFP4 flushes them.
With a budget of one BF16 Linear, tune must rank that Linear first and keep it in BF16. The config it
writes is then served: through ``Omni(quantization_config=...)`` (``compare --config @config.json``,
whose numbers must equal tune's own evaluation of the same selection, bit for bit) and through
``vllm serve --omni --diffusion-quantization-config``. One tune run is shared by the module.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.platform.omni_procs import (
    omni_installed,
    reap_group,
    run_bounded,
    serve_command,
    subprocess_env,
    video_job,
    wait_until_healthy,
)
from tests.support.ports import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]

PLANTED = "blocks.1.attn1.to_out"  # the runtime Linear (checkpoint name: PLANTED_CHECKPOINT)
PLANTED_CHECKPOINT = "blocks.1.attn1.to_out.0"
SHIFT = 10
PROMPTS = ("a cat walking on the grass", "a red ball on a table")
RUN = ["--steps", "3", "--height", "32", "--width", "32", "--num-frames", "5"]
WEIGHTS = "diffusion_pytorch_model.safetensors"


def plant(tensors: dict[str, torch.Tensor], shift: int = SHIFT) -> dict[str, torch.Tensor]:
    """The rescaled copy: V rows (and bias) of one channel per 32 times 2^shift, the output
    projection's matching columns times 2^-shift."""
    out = dict(tensors)
    channels = torch.arange(0, tensors["blocks.1.attn1.to_v.weight"].shape[0], 32)
    for name in ("blocks.1.attn1.to_v.weight", "blocks.1.attn1.to_v.bias"):
        t = tensors[name].clone()
        t[channels] *= 2.0**shift
        out[name] = t
    t = tensors[f"{PLANTED_CHECKPOINT}.weight"].clone()
    t[:, channels] *= 2.0**-shift
    out[f"{PLANTED_CHECKPOINT}.weight"] = t
    return out


@pytest.fixture(scope="module")
def planted_dir(tiny_dir: Path, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("planted") / "wan"
    root.mkdir()
    for entry in tiny_dir.iterdir():
        if entry.name != "transformer":
            (root / entry.name).symlink_to(entry)
    shutil.copytree(tiny_dir / "transformer", root / "transformer")
    save_file(plant(load_file(tiny_dir / "transformer" / WEIGHTS)), root / "transformer" / WEIGHTS)
    return root


def test_the_rescaling_keeps_the_bf16_function(tiny_dir: Path, planted_dir: Path):
    from diffusers import WanTransformer3DModel

    outs = []
    for root in (tiny_dir, planted_dir):
        model = WanTransformer3DModel.from_pretrained(root / "transformer", torch_dtype=torch.bfloat16).eval()
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(1, model.config.in_channels, 2, 8, 8, generator=generator).bfloat16()
        text = torch.randn(1, 8, model.config.text_dim, generator=generator).bfloat16()
        with torch.no_grad():
            outs.append(model(x, torch.tensor([500]), text, return_dict=False)[0])
    assert torch.equal(outs[0], outs[1])
    name = f"{PLANTED_CHECKPOINT}.weight"
    assert not torch.equal(
        load_file(planted_dir / "transformer" / WEIGHTS)[name],
        load_file(tiny_dir / "transformer" / WEIGHTS)[name],
    )


@pytest.fixture(scope="module")
def tuned(planted_dir: Path, tmp_path_factory):
    out = tmp_path_factory.mktemp("tune") / "out"
    argv = ["-m", "vllm_omni_mxfp4.cli", "tune", str(planted_dir)]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    argv += ["--seed", "7", "--eval-prompt", PROMPTS[0], "--eval-seed", "8", *RUN]
    argv += ["--max-bf16-layers", "1", "--max-w4a8-steps", "1", "--candidates", "3", "--out", str(out)]
    log = out.parent / "tune.log"
    run_bounded(argv, timeout=1200, env=subprocess_env(), log=log)
    with open(out / "scores.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    return out, log.read_text(), rows, json.loads((out / "scores.json").read_text())


def test_the_planted_linear_is_ranked_first_and_kept(tuned):
    out, text, rows, scores = tuned
    planted = next(r for r in rows if r["component"] == "transformer" and r["layer"] == PLANTED)
    others = [float(r["local_rel_error_w4a4"]) for r in rows if r is not planted]
    assert float(planted["local_rel_error_w4a4"]) > 10 * max(others)  # MXFP4's error grew large
    assert planted["candidate"] == "True" and planted["chosen"] == "bf16"
    gains = {(r["component"], r["layer"]): float(r["gain_used"]) for r in rows if r["gain_used"]}
    assert max(gains, key=gains.get) == ("transformer", PLANTED)
    config = json.loads((out / "config.json").read_text())
    assert config["transformer"]["ignored_layers"] == [PLANTED]
    assert config["transformer_2"]["ignored_layers"] == []
    assert len(config["transformer"]["w4a8_fallback_steps"]) == 1
    assert scores["tuned"]["final_mse"] < scores["all_w4a4"]["final_mse"]
    assert "PSNR" in text and "cost: 6 passes (candidates + 3) x 2 tuning request(s) = 12 generations" in text


def test_every_output_is_written(tuned):
    out, _, rows, scores = tuned
    assert len(rows) == 32  # 8 runtime Linears per block, 2 blocks, 2 experts
    assert {r["chosen"] for r in rows} == {"bf16", "w4a4"}
    assert [s["step"] for s in scores["steps"]] == [0, 1, 2]
    assert all(s["rel_error_w4a4"] > s["rel_error_w4a8"] for s in scores["steps"])
    assert scores["cost"]["tuning_generations"] == 12 and scores["cost"]["evaluation_generations"] == 10
    labels = [e["label"] for e in scores["evaluation"]]
    assert labels == [
        "bf16",
        "all-w4a4",
        "first-blocks",
        "edge-prior",
        *(f"random-{i}" for i in range(5)),
        "tuned",
    ]
    assert scores["stability_spearman"]["local"] >= 0.8  # the two halves rank the Linears alike
    from PIL import Image

    with Image.open(out / "report.png") as png:
        assert png.size[0] >= 800 and png.size[1] >= 600


def test_the_config_serves_through_omni_as_tune_measured_it(tuned, planted_dir: Path, tmp_path: Path):
    """compare runs BF16 and the written config (Omni(quantization_config=...)) on tune's evaluation
    request: the same numbers as tune's evaluation of its selection inside the tuning engine."""
    out, _, _, scores = tuned
    argv = ["-m", "vllm_omni_mxfp4.cli", "compare", str(planted_dir), "--prompt", PROMPTS[0], "--seed", "8"]
    argv += ["--config", f"tuned=@{out / 'config.json'}", *RUN, "--out", str(tmp_path / "compare")]
    run_bounded(argv, timeout=900, env=subprocess_env(), log=tmp_path / "compare.log")
    compared = {
        c["label"]: c for c in json.loads((tmp_path / "compare" / "compare.json").read_text())["configs"]
    }
    evaluated = {e["label"]: e for e in scores["evaluation"]}
    assert compared["tuned"]["final"] == evaluated["tuned"]["final"]
    assert [s["cosine"] for s in compared["tuned"]["steps"]] == [
        s["cosine"] for s in evaluated["tuned"]["steps"]
    ]


@pytest.mark.skipif(
    importlib.util.find_spec("torchaudio") is None,
    reason="torchaudio is not installed; vLLM-Omni's API server cannot start without it",
)
def test_the_config_serves_through_vllm_serve(tuned, planted_dir: Path, tmp_path: Path):
    """``vllm serve --omni --diffusion-quantization-config "$(cat config.json)"``: the planted Linear
    runs in BF16 (it never reaches the MXFP4 method), the chosen step runs W4A8, the rest W4A4."""
    out, _, _, _ = tuned
    config = json.loads((out / "config.json").read_text())
    port, log, trace = free_port(), tmp_path / "server.log", tmp_path / "trace.jsonl"
    argv = [
        *serve_command(planted_dir, port),
        "--diffusion-quantization-config",
        (out / "config.json").read_text(),
    ]
    env = subprocess_env({"VLLM_OMNI_MXFP4_TRACE_FILE": str(trace)})
    with open(log, "wb") as handle:
        server = subprocess.Popen(
            argv, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(base, server, log, 300.0)
        form = {
            "prompt": PROMPTS[0],
            "width": "32",
            "height": "32",
            "num_frames": "5",
            "num_inference_steps": "3",
        }
        assert video_job(base, form, log)["error"] is None
    finally:
        leftover = reap_group(server, settle=30.0)
    assert not leftover, f"server processes {leftover} outlived SIGTERM by 30s"
    calls = [json.loads(line) for line in trace.read_text().splitlines() if '"step": null' not in line]
    layers = {(c["pid"], c["layer"]): c["prefix"] for c in calls}
    assert len(layers) == 31  # 32 quantized Linears, less the planted one: only transformer_2's runs MXFP4
    assert list(layers.values()).count(PLANTED) == 1
    a8 = set(config["transformer"]["w4a8_fallback_steps"])
    assert {c["step"] for c in calls if c["precision"] == "w4a8"} == a8
    assert {c["precision"] for c in calls if c["step"] not in a8} == {"w4a4"}
