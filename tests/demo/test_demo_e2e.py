"""The demo, reduced (BF16 + the offline msModelSlim checkpoint, one step), as the README runs it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from tests.platform.omni_procs import omni_installed, run_bounded, subprocess_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]

FRAMES, SIZE = 9, 32


def _file_bytes(folder: Path, *, bias_bytes: int | None = None, shared_qkv_smooth: bool = False) -> int:
    """Bytes of a transformer's safetensors tensors, computed from the file alone.

    ``bias_bytes``: bytes per bias element as the model holds it (msModelSlim stores FP32 biases; the
    engine keeps the model dtype). ``shared_qkv_smooth``: the fused runtime Q/K/V holds one Smooth
    vector where the checkpoint stores three equal ones.
    """
    total = 0
    with safe_open(str(folder / "diffusion_pytorch_model.safetensors"), "pt") as f:
        for key in sorted(f.keys()):
            t = f.get_tensor(key)
            if shared_qkv_smooth and key.endswith(("attn1.to_k.mul_scale", "attn1.to_v.mul_scale")):
                continue
            per = bias_bytes if (bias_bytes and key.endswith(".bias")) else t.element_size()
            total += t.numel() * per
    return total


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    argv = [
        "-m",
        "vllm_omni_mxfp4_demo",
        "--random-weights",
        "--modes",
        "offline,msmodelslim-svd16",
        "--steps",
        "1",
        "--out",
        str(out),
    ]
    argv += ["--height", str(SIZE), "--width", str(SIZE), "--num-frames", str(FRAMES)]
    log = out.parent / "demo.log"
    run_bounded(argv, timeout=600, env=subprocess_env(), log=log)
    return out, log.read_text(), json.loads((out / "results.json").read_text())


def test_table_and_numbers(demo_run):
    out, text, results = demo_run
    modes = {m["mode"]: m for m in results["modes"]}
    assert list(modes) == ["bf16", "offline", "msmodelslim-svd16"]
    assert "mode" in text and "PSNR dB" in text and "weights MiB" in text
    bf16, offline = modes["bf16"], modes["offline"]
    assert bf16["psnr"] == math.inf and bf16["cosine"] == pytest.approx(1.0)
    assert 10.0 < offline["psnr"] < math.inf
    assert 0.5 < offline["cosine"] < 1.0
    other = results["bf16_other_seed"]
    assert other["seed"] == 43 and math.isfinite(other["psnr"])
    for m in (bf16, offline):
        assert m["load_s"] > 0 and m["gen_s"] > 0
    assert results["platform"].startswith("CpuOmniPlatform")
    assert f"Output directory: {out}" in text


def _fp32_bias_slack(folder: Path) -> int:
    """Bytes the engine may hold beyond the file for BF16 Linears' biases: on a CPU with AMX tiles,
    vLLM packs small BF16 Linears for SGL's kernel and keeps their biases in FP32
    (``check_cpu_sgl_kernel`` in ``vllm.model_executor.layers.utils``), 2 more bytes per element;
    elsewhere none."""
    if not torch.cpu._is_amx_tile_supported():
        return 0
    with safe_open(str(folder / "diffusion_pytorch_model.safetensors"), "pt") as f:
        return sum(2 * math.prod(f.get_slice(k).get_shape()) for k in f.keys() if k.endswith(".bias"))  # noqa: SIM118 (safe_open is not iterable)


def _assert_holds(t: dict, expected: int, slack: int) -> None:
    held = t["weight_bytes"]
    assert expected <= held <= expected + slack and (held - expected) % 2 == 0, (
        t["name"],
        held,
        expected,
        slack,
    )


def test_weight_bytes_are_what_the_checkpoints_hold(demo_run):
    out, _, results = demo_run
    modes = {m["mode"]: m for m in results["modes"]}
    original, merged = Path(results["model"]), Path(results["offline_checkpoint"])
    for t in modes["bf16"]["transformers"]:
        folder = original / t["name"]
        _assert_holds(t, _file_bytes(folder), _fp32_bias_slack(folder))
        assert t["backend_bytes"] == 0
    for t in modes["offline"]["transformers"]:
        folder = merged / t["name"]
        expected = _file_bytes(folder, bias_bytes=2, shared_qkv_smooth=True)
        _assert_holds(t, expected, _fp32_bias_slack(folder))
    assert modes["offline"]["weight_bytes"] < 0.7 * modes["bf16"]["weight_bytes"]


def test_offline_mode_ran_the_merged_checkpoint_as_declared(demo_run):
    """Each expert's Linears run BF16 exactly where its merged config.json says (auto-detected)."""
    out, text, results = demo_run
    assert (out / "msmodelslim-export" / "high_noise_model").is_dir()
    assert (out / "msmodelslim-export" / "low_noise_model").is_dir()
    offline = next(m for m in results["modes"] if m["mode"] == "offline")
    assert offline["omni_kwargs"] == {}
    for t in offline["transformers"]:
        config = json.loads((out / "merged-mxfp4-dualscale" / t["name"] / "config.json").read_text())
        qc = config["quantization_config"]
        assert qc["quant_method"] == "mxfp4_dualscale" and qc["is_checkpoint_serialized"] is True
        bf16 = {e["layer"] for e in t["linears"] if e["method"] == "bf16"}
        quantized = {e["layer"] for e in t["linears"] if e["method"] == "mxfp4_dualscale"}
        assert bf16 == {name for name in qc["ignored_layers"] if name.startswith("blocks.")}
        assert quantized and not quantized & bf16
        assert {e["mode"] for e in t["linears"] if e["method"] != "bf16"} == {"offline"}
    assert "merged msModelSlim checkpoint" in text


def test_files(demo_run):
    import imageio.v3 as iio

    out, _, results = demo_run
    with Image.open(out / "frames_strip.png") as strip:
        assert strip.size[1] == 3 * (96 + 4)  # one row per mode, 32 px frames enlarged x3
    for mode in ("bf16", "offline"):
        video = iio.imread(out / f"{mode}.mp4", index=None)
        assert video.shape[0] == FRAMES and video.shape[3] == 3
        frames = np.load(out / "runs" / mode / "frames_0.npy")  # what Omni returned
        assert frames.shape == (1, FRAMES, SIZE, SIZE, 3) and np.isfinite(frames).all()
    assert "| offline |" in (out / "results.md").read_text()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """The demo on the trained tiny Wan2.2 it ships, reduced to the modes its training changes: the bad
    configuration, the NVFP4 source and the calibrated msModelSlim export (each with the
    prompt-accuracy set)."""
    from vllm_omni_mxfp4_demo import accuracy

    out = tmp_path_factory.mktemp("trained") / "out"
    argv = ["-m", "vllm_omni_mxfp4_demo", "--modes", "naive-w4a4,nvfp4,offline", "--out", str(out)]
    # The demo's own video is the set's first request, which the engine renders again in a batch.
    argv += ["--prompt", accuracy.VIDEO.requests()[0][0].text]
    log = out.parent / "demo.log"
    run_bounded(argv, timeout=900, env=subprocess_env(), log=log)
    return out, log.read_text(), json.loads((out / "results.json").read_text())


def test_msmodelslim_svd_export_runs_its_pairs_through_omni(demo_run):
    """msModelSlim's svd_res recipe (vllm_omni_mxfp4_tiny/recipes), merged: Omni(...) auto-detects it and
    every quantized Linear the merged config lists runs with its stored rank-16 pair, the others without."""
    out, text, results = demo_run
    svd = next(m for m in results["modes"] if m["mode"] == "msmodelslim-svd16")
    assert svd["omni_kwargs"] == {} and not svd.get("error")
    for t in svd["transformers"]:
        config = json.loads((out / "merged-svd16" / t["name"] / "config.json").read_text())
        ranks = config["quantization_config"]["svd_lowrank_layers"]
        quantized = {e["layer"]: e["low_rank"] for e in t["linears"] if e["method"] == "mxfp4"}
        assert quantized and set(quantized) == set(ranks), t["name"]
        assert set(quantized.values()) == {16}
    assert "keep a low-rank pair" in text


def test_trained_model_runs_by_default_with_prompt_accuracy(trained_run):
    from vllm_omni_mxfp4_tiny.trained_wan import EVAL_GUIDANCE, EVAL_GUIDANCE_2, SHIPPED

    out, text, results = trained_run
    assert Path(results["model"]) == SHIPPED
    assert results["settings"]["guidance_scale"] == EVAL_GUIDANCE
    assert results["settings"]["guidance_scale_2"] == EVAL_GUIDANCE_2
    modes = {m["mode"]: m for m in results["modes"]}
    assert list(modes) == ["bf16", "naive-w4a4", "offline", "nvfp4"]
    assert not any(m.get("error") for m in modes.values())
    for m in modes.values():
        assert m["accuracy"]["seen"]["outputs"] == 8 and m["accuracy"]["held_out"]["outputs"] == 4
    assert "accuracy seen" in text and "accuracy held-out" in text


def test_batched_evaluation_gives_each_request_its_own_video(trained_run):
    """The set's videos come from one batched generate call per seed; its first request is the demo's own
    (prompt, seed), rendered alone: the same video (another seed is about 20 dB away, see the summary)."""
    out, _, results = trained_run
    for mode in ("bf16", "naive-w4a4", "offline", "nvfp4"):
        alone = np.load(out / "runs" / mode / "frames_0.npy")
        batched = np.load(out / "runs" / mode / "evaluation.npy")
        assert batched.shape[0] == 12 and batched[0].shape == alone.shape
        error = float(np.mean((batched[0] - alone) ** 2))
        assert error == 0.0 or 10 * math.log10(1.0 / error) > 50, (mode, error)
        assert float(np.mean((batched[1] - alone) ** 2)) > 1e-4  # another prompt: another video


def test_bad_configuration_quantizes_the_plain_linears_too(trained_run):
    """naive-w4a4: the block Linears through the package's mxfp4, and W4A4 on exactly the Linears
    vLLM-Omni builds as plain torch Linears (embedders, proj_out) of both experts."""
    _, _, results = trained_run
    naive = next(m for m in results["modes"] if m["mode"] == "naive-w4a4")
    assert naive["omni_kwargs"] == {"quantization": "mxfp4"}
    expected = {
        "condition_embedder.time_embedder.linear_1",
        "condition_embedder.time_embedder.linear_2",
        "condition_embedder.time_proj",
        "condition_embedder.text_embedder.linear_1",
        "condition_embedder.text_embedder.linear_2",
        "proj_out",
    }
    assert {name: set(layers) for name, layers in naive["naive_w4a4"].items()} == {
        "transformer": expected,
        "transformer_2": expected,
    }
    for t in naive["transformers"]:
        methods = {e["method"] for e in t["linears"]}
        assert methods == {"mxfp4"}, (t["name"], methods)
    assert naive["psnr"] < math.inf


def test_the_trained_models_export_is_calibrated(trained_run):
    """msModelSlim's Smooth factors for the trained model come from a calibration run; with them the
    offline DualScale checkpoint is far closer to BF16 than the bad configuration (measured: 29.1 dB
    against 21.7; synthetic statistics gave 19.4 on the previous model)."""
    _, text, results = trained_run
    assert "msModelSlim: calibrating Smooth on 16 training prompts x 1 training seed(s)" in text
    modes = {m["mode"]: m for m in results["modes"]}
    assert modes["offline"]["psnr"] > modes["naive-w4a4"]["psnr"] + 3.0


def test_nvfp4_mode_serves_the_compressed_tensors_copy_requantized(trained_run):
    out, _, results = trained_run
    nvfp4 = next(m for m in results["modes"] if m["mode"] == "nvfp4")
    config = json.loads((out / "nvfp4-compressed-tensors" / "transformer" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    for t in nvfp4["transformers"]:
        assert t["nvfp4"], t["name"]  # the load-time requantization's records
        assert {e["method"] for e in t["linears"]} == {"mxfp4"}


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory):
    """The demo with --model on the trained tiny FLUX.1-dev it ships: BF16 (the reference), online mxfp4
    and the bad configuration, each with the image prompt-accuracy set; offline and W4A8 by step asked
    for too, which the demo skips (its exports are made for Wan2.2 only; vLLM-Omni's FLUX pipeline
    publishes no denoising step)."""
    from vllm_omni_mxfp4_tiny import trained_flux

    out = tmp_path_factory.mktemp("flux") / "out"
    argv = ["-m", "vllm_omni_mxfp4_demo", "--model", str(trained_flux.SHIPPED)]
    argv += ["--modes", "mxfp4,naive-w4a4,mxfp4-w4a8,offline", "--out", str(out)]
    log = out.parent / "demo.log"
    run_bounded(argv, timeout=900, env=subprocess_env(), log=log)
    return out, log.read_text(), json.loads((out / "results.json").read_text())


def test_the_trained_image_model_gets_the_table_through_the_model_option(flux_run):
    """Its own defaults (32x32, 20 steps, distilled guidance 3), one PNG per mode, the strip, prompt
    accuracy per mode, and BF16 drawing what it is prompted on the seen prompts through vLLM-Omni's own
    FluxPipeline."""
    from vllm_omni_mxfp4_demo.accuracy import IMAGE
    from vllm_omni_mxfp4_tiny import trained_flux

    out, text, results = flux_run
    assert "offline skipped: the demo makes its msModelSlim exports and NVFP4 copy for Wan2.2 only" in text
    assert "mxfp4-w4a8 skipped: W4A8 by step needs the denoising step" in text
    assert results["settings"]["guidance_scale"] == trained_flux.GUIDANCE
    modes = {m["mode"]: m for m in results["modes"]}
    assert list(modes) == ["bf16", "mxfp4", "naive-w4a4"]
    assert not any(m.get("error") for m in modes.values())
    for name, m in modes.items():
        assert m["accuracy"]["seen"]["outputs"] == IMAGE.seen and m["accuracy"]["held_out"]["outputs"] == 4
        assert set(m["accuracy"]["seen"]["per_attribute"]) == {"colour", "shape", "position", "background"}
        with Image.open(out / f"{name}.png") as image:
            assert image.size == (256, 256)  # 32 px enlarged x8
        frames = np.load(out / "runs" / name / "frames_0.npy")
        assert frames.shape == (1, trained_flux.HEIGHT, trained_flux.WIDTH, 3)
    assert modes["bf16"]["accuracy"]["seen"]["accuracy"] >= 0.8
    with Image.open(out / "frames_strip.png") as strip:
        assert strip.size[1] == 3 * (96 + 4)  # one row per mode
    assert "accuracy seen" in (out / "results.md").read_text()


def test_the_image_models_single_stream_block_is_what_the_methods_quantize(flux_run):
    """BF16 builds the single-stream block's fused QKV, proj_mlp and proj_out with the quantization
    slot left BF16, mxfp4 quantizes exactly those (the modulation Linears, built with no quantization
    config, stay BF16), and the bad configuration adds W4A4 on FLUX's plain Linears (the time,
    guidance and text embedders, x_embedder, context_embedder, proj_out) — and costs quality against
    mxfp4."""
    _, _, results = flux_run
    modes = {m["mode"]: m for m in results["modes"]}
    block = "single_transformer_blocks.0."
    wanted = {f"{block}attn.to_qkv", f"{block}proj_mlp", f"{block}proj_out"}
    for name, method in (("bf16", "bf16"), ("mxfp4", "mxfp4")):
        (report,) = modes[name]["transformers"]
        methods = {e["layer"]: e["method"] for e in report["linears"]}
        assert wanted <= set(methods) and {methods[w] for w in wanted} == {method}, (name, methods)
        assert {m for layer, m in methods.items() if layer not in wanted} <= {"bf16"}, (name, methods)
    plain = set(modes["naive-w4a4"]["naive_w4a4"]["transformer"])
    embedders = {
        f"time_text_embed.{e}_embedder.linear_{i}" for e in ("timestep", "guidance", "text") for i in (1, 2)
    }
    assert plain == embedders | {"x_embedder", "context_embedder", "proj_out"}
    assert not any(name.startswith(block) for name in plain)
    assert modes["naive-w4a4"]["psnr"] < modes["mxfp4"]["psnr"]
