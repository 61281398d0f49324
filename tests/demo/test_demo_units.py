"""The demo's parts without an engine: metrics, media, modes, the report, the engine job's input."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from vllm_omni_mxfp4.compare.metrics import cosine, psnr
from vllm_omni_mxfp4.compare.run import model_boundary_ratio
from vllm_omni_mxfp4.config import parse_quantization
from vllm_omni_mxfp4_demo import main, media, modes, report
from vllm_omni_mxfp4_tiny.engine_job import Job

# ------------------------------------------------------------------------------------------------ metrics


def test_psnr_golden_values():
    ref = np.zeros((2, 4, 4, 3), dtype=np.float32)
    assert psnr(np.full_like(ref, 0.1), ref) == pytest.approx(20.0, abs=1e-6)  # MSE 0.01
    assert psnr(np.full_like(ref, 0.01), ref) == pytest.approx(40.0, abs=1e-5)
    assert psnr(ref, ref) == math.inf
    bad = ref.copy()
    bad[0, 0, 0, 0] = np.nan
    assert math.isnan(psnr(bad, ref))
    with pytest.raises(ValueError, match="different shapes"):
        psnr(ref, ref[:1])


def test_cosine_golden_values():
    a = np.array([1.0, 1.0, 0.0, 0.0]).reshape(1, 1, 4, 1)  # -> [1, 1, -1, -1]
    b = np.array([1.0, 0.0, 1.0, 0.0]).reshape(1, 1, 4, 1)  # -> [1, -1, 1, -1]
    assert cosine(a, a) == pytest.approx(1.0)
    assert cosine(a, 1.0 - a) == pytest.approx(-1.0)
    assert cosine(a, b) == pytest.approx(0.0, abs=1e-12)
    c = np.array([1.0, 0.75, 0.5, 0.5]).reshape(1, 1, 4, 1)  # -> [1, 0.5, 0, 0]
    assert cosine(a, c) == pytest.approx(1.5 / (2.0 * math.sqrt(1.25)))
    assert math.isnan(cosine(np.full_like(a, 0.5), a))


# ------------------------------------------------------------------------------------------------ media


class _Output:
    def __init__(self, images):
        self.images = images


def test_video_frames_layouts():
    video = np.random.default_rng(0).random((1, 5, 6, 7, 3), dtype=np.float32)
    np.testing.assert_array_equal(media.video_frames([_Output([video])]), video[0])
    np.testing.assert_array_equal(media.video_frames(torch.from_numpy(video[0])), video[0])
    channel_first = np.moveaxis(video[0], -1, 0)  # (3, F, H, W)
    np.testing.assert_array_equal(media.video_frames(channel_first), video[0])
    as_uint8 = (video[0] * 255).astype(np.uint8)
    np.testing.assert_allclose(media.video_frames(as_uint8), as_uint8 / 255.0, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="batch of 2"):
        media.video_frames(np.zeros((2, 5, 6, 7, 3)))
    with pytest.raises(ValueError, match="no images"):
        media.video_frames([_Output([])])


def _gradient(frames: int, height: int, width: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / (width - 1), y / (height - 1), np.full((height, width), 0.5)], axis=-1)
    return np.stack([np.roll(base, t, axis=1) for t in range(frames)]).astype(np.float32)


@pytest.mark.skipif(media.video_encoder() is None, reason="no MP4 encoder installed")
def test_mp4_round_trip_and_even_padding(tmp_path):
    import imageio.v3 as iio

    frames = _gradient(6, 33, 48)
    path = media.write_video(frames, tmp_path / "v.mp4", fps=8)
    assert path == tmp_path / "v.mp4"
    back = iio.imread(path, index=None)
    assert back.shape == (6, 34, 48, 3)  # odd height padded by one edge row for yuv420p
    error = np.abs(back[:, :33].astype(np.float64) / 255.0 - frames).mean()
    assert error < 0.05  # H.264 is lossy; a wrong layout would be off by ~0.3


def test_gif_fallback_without_encoder(tmp_path, monkeypatch):
    monkeypatch.setattr(media, "video_encoder", lambda: None)
    frames = _gradient(4, 8, 10)
    path = media.write_video(frames, tmp_path / "v.mp4", fps=10)
    assert path == tmp_path / "v.gif" and not (tmp_path / "v.mp4").exists()
    with Image.open(path) as gif:
        assert gif.n_frames == 4 and gif.size == (10, 8)
        assert gif.info["duration"] == 100


def test_frame_strip_layout(tmp_path):
    a = _gradient(5, 16, 16)
    b = 1.0 - a
    path = media.frame_strip([("first", a), ("second", b)], tmp_path / "s.png", max_frames=3, min_size=64)
    with Image.open(path) as img:
        pixels = np.asarray(img.convert("RGB"))
    tile, gap, label = 64, 4, 150  # 16 px enlarged x4
    assert pixels.shape == (2 * (tile + gap), label + 3 * (tile + gap), 3)
    # Row 2, third tile = frame 4 of b (frames 0, 2, 4 are picked), enlarged by 4.
    y, x = tile + gap, label + 2 * (tile + gap)
    expected = media.to_uint8(b[4])
    np.testing.assert_array_equal(pixels[y + 4 * 3, x + 4 * 5], expected[3, 5])
    np.testing.assert_array_equal(pixels[y + 4 * 3 + 3, x + 4 * 5 + 3], expected[3, 5])


# ------------------------------------------------------------------------------------------------ modes and table


def test_parse_modes_adds_the_reference_and_keeps_order():
    assert [m.name for m in modes.parse_modes("offline")] == ["bf16", "offline"]
    assert [m.name for m in modes.parse_modes("dualscale, mxfp4")] == ["bf16", "mxfp4", "dualscale"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown mode.*nope.*choose from bf16"):
        modes.parse_modes("mxfp4,nope")


def test_unknown_mode_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        modes.build_parser().parse_args(["--modes", "fp8"])
    assert info.value.code == 2 and "unknown mode(s) fp8" in capsys.readouterr().err


def test_low_rank_modes_run_only_when_named():
    default = [m.name for m in modes.build_parser().parse_args([]).modes]
    assert default and not any(name.startswith("mxfp4-svd") for name in default)
    named = modes.build_parser().parse_args(["--modes", "mxfp4-svd16,mxfp4"]).modes
    assert [m.name for m in named] == ["bf16", "mxfp4", "mxfp4-svd16"]
    assert named[2].omni_kwargs(10) == {"quantization_config": {"method": "mxfp4", "svd_rank": 16}}


def test_every_mode_is_a_valid_config():
    by_name = {m.name: m for m in modes.MODES}
    assert by_name["mxfp4-w4a8"].omni_kwargs(1) == {
        "quantization_config": {"method": "mxfp4", "w4a8_fallback_steps": [0]}
    }
    assert by_name["mxfp4-w4a8"].omni_kwargs(20)["quantization_config"]["w4a8_fallback_steps"] == [0, 19]
    assert by_name["bf16"].omni_kwargs(20) == {} and by_name["offline"].omni_kwargs(20) == {}
    for mode in modes.MODES:
        kwargs = mode.omni_kwargs(8)
        spec = kwargs.get("quantization", kwargs.get("quantization_config"))
        if spec is not None:
            assert parse_quantization(spec) is not None, mode.name


def test_table_rows():
    results = [
        {
            "mode": "bf16",
            "psnr": math.inf,
            "cosine": 1.0,
            "weight_bytes": 100 * report.MIB,
            "backend_bytes": 0,
        }
        | {"load_s": 10.0, "gen_s": 1.234},
        {"mode": "mxfp4", "psnr": 31.456, "cosine": 0.99123456, "weight_bytes": 46 * report.MIB}
        | {"backend_bytes": 2 * report.MIB, "load_s": 12.25, "gen_s": 2.0},
        {"mode": "offline", "error": "boom"},
    ]
    rows = report.table_rows(results)
    assert rows[1] == ["bf16", "inf", "1.00000", "100.00", "1.000x", "0.00", "10.0", "1.23"]
    assert rows[2] == ["mxfp4", "31.46", "0.99123", "46.00", "0.460x", "2.00", "12.2", "2.00"]
    assert rows[3][:2] == ["offline", "failed"]
    text = report.format_table(rows)
    assert text.splitlines()[1].startswith("----")
    assert (
        report.markdown_table(rows).splitlines()[2]
        == "| bf16 | inf | 1.00000 | 100.00 | 1.000x | 0.00 | 10.0 | 1.23 |"
    )


def test_table_rows_add_prompt_accuracy_when_a_mode_was_scored():
    base = {"psnr": 30.0, "cosine": 0.99, "weight_bytes": report.MIB, "backend_bytes": 0, "load_s": 1.0}
    scored = {
        "seen": {"outputs": 24, "accuracy": 0.875, "per_attribute": {}},
        "held_out": {"outputs": 12, "accuracy": 0.25, "per_attribute": {}},
    }
    results = [
        {"mode": "bf16", **base, "gen_s": 1.0, "accuracy": scored, "set_psnr": math.inf},
        {"mode": "mxfp4", **base, "gen_s": 1.0},  # scored nowhere: not available
        {"mode": "offline", "error": "boom"},
    ]
    rows = report.table_rows(results)
    assert rows[0][:6] == ["mode", "PSNR dB", "cosine", "set PSNR dB", "accuracy seen", "accuracy held-out"]
    assert rows[1][3:6] == ["inf", "88% of 24", "25% of 12"] and rows[2][3:6] == ["n/a", "n/a", "n/a"]
    assert rows[3] == ["offline", "failed"] + [""] * (len(rows[0]) - 2)
    assert all(len(row) == len(rows[0]) for row in rows)
    assert "accuracy" not in " ".join(report.table_rows([dict(results[1])])[0])


def test_a_trained_model_takes_the_tasks_defaults_and_explicit_flags_win(tmp_path):
    from vllm_omni_mxfp4_demo.trained import FLUX, WAN
    from vllm_omni_mxfp4_tiny.task import ImagePrompt, VideoPrompt

    args = modes.build_parser().parse_args(["--model", str(tmp_path), "--steps", "3", "--seed", "0"])
    size = modes.resolve_defaults(args, WAN)
    assert size == {**{k: WAN.defaults[k] for k in modes.SIZE_KEYS}, "steps": 3}
    assert args.seed == 0 and args.prompt == WAN.defaults["prompt"] and args.negative_prompt == ""
    assert not VideoPrompt.parse(args.prompt).held_out  # a prompt the model was trained on
    args = modes.build_parser().parse_args(["--model", str(tmp_path)])
    assert modes.resolve_defaults(args, FLUX) == {k: FLUX.defaults[k] for k in modes.SIZE_KEYS}
    assert (
        not ImagePrompt.parse(args.prompt).held_out and args.guidance_scale == FLUX.defaults["guidance_scale"]
    )
    args = modes.build_parser().parse_args([])  # the shipped trained model
    assert modes.resolve_defaults(args, WAN)["num_frames"] == WAN.defaults["num_frames"]
    args = modes.build_parser().parse_args(["--random-weights"])
    assert modes.resolve_defaults(args, None)["height"] == modes.TINY_DEFAULTS["height"]
    assert args.guidance_scale == modes.TINY_DEFAULTS["guidance_scale"]
    args = modes.build_parser().parse_args(["--model", str(tmp_path)])
    assert modes.resolve_defaults(args, None)["num_frames"] == modes.MODEL_DEFAULTS["num_frames"]


def _manifested(directory, command):
    from vllm_omni_mxfp4_tiny.training_command import MANIFEST, file_hashes

    (directory / "model_index.json").write_text("{}")
    (directory / MANIFEST).write_text(json.dumps({"command": command, "sha256": file_hashes(directory)}))
    return directory


def test_trained_models_are_told_apart_by_their_manifests_command(tmp_path):
    from vllm_omni_mxfp4_demo.trained import FLUX, WAN, trained_model
    from vllm_omni_mxfp4_tiny import trained_flux, trained_wan

    assert trained_model(trained_wan.SHIPPED) is WAN and trained_model(trained_flux.SHIPPED) is FLUX
    assert trained_model(tmp_path) is None  # no manifest: not a trained tiny pipeline
    assert trained_model(_manifested(tmp_path, FLUX.command)) is FLUX
    _manifested(tmp_path, "python train_mine.py")
    with pytest.raises(
        ValueError, match=r"TRAINING.json: command 'python train_mine.py' is none of the demo"
    ):
        trained_model(tmp_path)
    (tmp_path / "TRAINING.json").write_text("[1, 2")
    with pytest.raises(ValueError, match=r"TRAINING.json: not a training manifest"):
        trained_model(tmp_path)


def test_a_trained_model_whose_files_changed_exits_2(tmp_path, capsys):
    from vllm_omni_mxfp4_demo.trained import WAN

    _manifested(tmp_path, WAN.command)
    (tmp_path / "model_index.json").write_text('{"changed": true}')
    assert main.main(["--model", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"--model {tmp_path}" in err and "model_index.json: SHA-256" in err
    assert f"rerun `{WAN.command}`" in err


def test_random_weights_and_a_model_together_exit_2(tmp_path, capsys):
    assert main.main(["--random-weights", "--model", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "--random-weights and --model: give one" in capsys.readouterr().err


def test_a_checkout_without_the_shipped_model_says_how_to_make_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(main, "SHIPPED", tmp_path / "wan22_t2v")
    assert main.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "wan22_t2v") in err and "python -m vllm_omni_mxfp4_tiny.trained_wan" in err
    assert "--random-weights" in err


def _transformer(name: str, method: str, weight_bytes: int) -> dict:
    linear = {"layer": "blocks.0.ffn.net_2", "method": method}
    if method != "bf16":
        linear |= {"backend": "emulated", "mode": "online", "act_scale_rule": "floor", "precision": "w4a4"}
        linear["w4a8_steps"] = []
    info = {"name": name, "weight_bytes": weight_bytes, "kernel_bytes": 0, "backend_bytes": 0}
    return info | {"linears": [linear], "ranks": 1}


def test_set_psnr_is_the_mean_over_the_accuracy_sets_outputs_against_bf16s():
    reference = np.stack([_gradient(3, 8, 8), 1.0 - _gradient(3, 8, 8)])
    shifted = np.clip(reference + np.array([0.01, 0.1])[:, None, None, None, None], 0, 1)
    results = [{"mode": "bf16"}, {"mode": "mxfp4"}, {"mode": "short"}]
    evaluation = {"bf16": reference, "mxfp4": shifted, "short": shifted[:1]}
    report.score(results, {}, evaluation)
    want = np.mean([psnr(shifted[i], reference[i]) for i in range(2)])
    assert results[1]["set_psnr"] == pytest.approx(want) and results[0]["set_psnr"] == math.inf
    assert "set_psnr" not in results[2]  # a set of another size is not compared


def test_report_writes_the_numbers_and_prints_the_summary(tmp_path, capsys):
    frames = {"bf16": _gradient(3, 8, 8), "mxfp4": _gradient(3, 8, 8) * 0.9}
    results = [
        {"mode": "bf16", "description": "the reference", "platform": "CpuOmniPlatform (device cpu)"}
        | {"load_s": 1.0, "gen_s": 0.5, "weight_bytes": 2 * report.MIB, "backend_bytes": 0}
        | {"transformers": [_transformer("transformer", "bf16", 2 * report.MIB)]},
        {"mode": "mxfp4", "description": "quantized", "platform": "CpuOmniPlatform (device cpu)"}
        | {"load_s": 2.0, "gen_s": 0.75, "weight_bytes": report.MIB, "backend_bytes": report.MIB}
        | {"transformers": [_transformer("transformer", "mxfp4", report.MIB)]},
        {"mode": "offline", "description": "merged", "error": "offline step failed: boom"},
    ]
    settings = {"prompt": "a cat", "negative_prompt": "", "seed": 42, "guidance_scale": 5.0}
    summary = report.Summary(tmp_path, tmp_path / "model", None, settings, results)
    report.score(results, frames)
    report.write_media(summary, frames)
    summary.other_seed = report.other_seed(frames["bf16"], 1.0 - frames["bf16"], 43)
    report.publish(summary)

    numbers = json.loads((tmp_path / "results.json").read_text())
    assert [m["mode"] for m in numbers["modes"]] == ["bf16", "mxfp4", "offline"]
    assert numbers["platform"] == "CpuOmniPlatform (device cpu)" and numbers["settings"] == settings
    assert numbers["modes"][1]["psnr"] == pytest.approx(psnr(frames["mxfp4"], frames["bf16"]))
    assert numbers["bf16_other_seed"]["seed"] == 43 and numbers["offline_checkpoint"] is None
    assert summary.failed == ["offline"] and set(summary.videos) == {"bf16", "mxfp4"}
    assert (tmp_path / "frames_strip.png").is_file()
    markdown = (tmp_path / "results.md").read_text()
    assert "| mxfp4 | " in markdown and "| offline | failed |" in markdown and "- offline: merged" in markdown
    printed = capsys.readouterr().out
    assert "Platform: CpuOmniPlatform (device cpu)" in printed and "weights MiB" in printed
    assert "    transformer: 1 Linears: 1 mxfp4 online W4A4 [backend emulated, A4 scale OCP]" in printed
    assert "    FAILED: offline step failed: boom" in printed
    assert "For scale, BF16 with seed 43 instead of 42" in printed
    assert f"Output directory: {tmp_path}" in printed


def test_the_strip_rows_follow_the_table_not_the_order_engines_finished(tmp_path):
    frames = {"mxfp4": np.full((2, 8, 8, 3), -0.5), "bf16": np.full((2, 8, 8, 3), 0.5)}  # mxfp4 done first
    results = [{"mode": "bf16"}, {"mode": "mxfp4"}]
    summary = report.Summary(tmp_path, tmp_path / "model", None, {}, results)
    report.write_media(summary, frames)
    with Image.open(summary.strip) as img:
        pixels = np.asarray(img.convert("RGB"))
    tile, gap, label = 96, 4, 150  # 8 px enlarged x12 to the strip's minimum of 96
    first_row, second_row = (
        pixels[tile // 2, label + tile // 2],
        pixels[tile + gap + tile // 2, label + tile // 2],
    )
    np.testing.assert_array_equal(first_row, media.to_uint8(frames["bf16"])[0, 0, 0])
    np.testing.assert_array_equal(second_row, media.to_uint8(frames["mxfp4"])[0, 0, 0])


def test_a_model_that_is_not_a_pipeline_exits_2(tmp_path, capsys):
    assert main.main(["--model", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "not a diffusers pipeline directory (no model_index.json)" in capsys.readouterr().err
    (tmp_path / "model_index.json").write_text("{}")
    assert main.main(["--model", str(tmp_path), "--quant-path", str(tmp_path / "nope")]) == 2
    assert "--quant-path" in capsys.readouterr().err


def test_engine_job_input(tmp_path):
    job = Job.from_dict({"model": "m", "out": "o", "seeds": [1, 2], "omni_kwargs": {"quantization": "mxfp4"}})
    assert job.seeds == [1, 2] and job.steps == Job("m", "o").steps
    with pytest.raises(ValueError, match=r"unknown keys \['seed'\], missing keys \['out'\]"):
        Job.from_dict({"model": "m", "seed": 1})
    assert model_boundary_ratio(tmp_path) is None
    (tmp_path / "model_index.json").write_text(json.dumps({"boundary_ratio": 0.9}))
    assert model_boundary_ratio(tmp_path) == 0.9


def test_engine_job_evaluation_requests_are_checked_by_index():
    good = {"model": "m", "out": "o", "evaluation": [["a red bar", 1_000_000], ["a blue square", 7]]}
    assert Job.from_dict(json.loads(json.dumps(good))).evaluation == [
        ["a red bar", 1_000_000],
        ["a blue square", 7],
    ]
    for bad in (
        ["a blue square"],
        ["a blue square", -1],
        ["a blue square", "7"],
        [7, "a blue square"],
        ["a blue square", True],
    ):
        data = {**good, "evaluation": [good["evaluation"][0], bad]}
        with pytest.raises(
            ValueError, match=r"evaluation\[1\] is .*; expected \[prompt, seed\] with a seed >= 0"
        ):
            Job.from_dict(data)
    repeated = {**good, "evaluation": [*good["evaluation"], ["a red bar", 1_000_000]]}
    with pytest.raises(ValueError, match=r"evaluation\[2\] repeats the pair \('a red bar', 1000000\)"):
        Job.from_dict(repeated)


def test_engine_job_batches_the_evaluation_by_seed():
    from vllm_omni_mxfp4_tiny.engine_job import engine_kwargs, evaluation_groups

    pairs = [("a", 1), ("b", 2), ("c", 1), ("d", 1)]
    assert evaluation_groups(pairs) == {1: ["a", "c", "d"], 2: ["b"]}
    assert engine_kwargs(Job(model="m", out="o", evaluation=pairs))["max_num_seqs"] == 3
    assert "max_num_seqs" not in engine_kwargs(Job(model="m", out="o"))
    pinned = Job(model="m", out="o", evaluation=pairs, omni_kwargs={"max_num_seqs": 1})
    assert engine_kwargs(pinned)["max_num_seqs"] == 1


def test_a_recipe_that_shares_a_checkpoint_reuses_its_run(tmp_path):
    """wan-w4a4f8 runs w4a4f4's merged checkpoint with the same arguments: the demo reuses that run,
    and only when the checkpoint, the arguments and a finished run all match."""
    from vllm_omni_mxfp4_demo.main import DemoRun, _same_engine_run

    by_name = {m.name: m for m in modes.MODES}
    f4, f8 = by_name["wan-w4a4f4"], by_name["wan-w4a4f8"]
    merged = tmp_path / "merged-w4a4f4"

    def run(**changes) -> DemoRun:
        state = DemoRun(argparse.Namespace(), tmp_path, tmp_path, [f4, f8], {"steps": 10})
        state.recipe_models = {"wan-w4a4f4": merged, "wan-w4a4f8": merged, **changes.get("models", {})}
        state.results = [{"mode": "wan-w4a4f4", "omni_kwargs": {}, "psnr": 36.2, **changes.get("entry", {})}]
        state.frames = {"wan-w4a4f4": np.zeros((1, 2, 2, 3))}
        return state

    assert _same_engine_run(run(), f8, {})["psnr"] == 36.2
    assert _same_engine_run(run(), f4, {}) is None  # f4 is nobody's copy
    assert _same_engine_run(run(), f8, {"quantization": "mxfp4"}) is None
    assert _same_engine_run(run(entry={"error": "engine died"}), f8, {}) is None
    assert _same_engine_run(run(models={"wan-w4a4f8": tmp_path / "other"}), f8, {}) is None


def test_tiny_models_run_two_engines_at_a_time_with_a_share_of_the_cores_each(monkeypatch, tmp_path):
    from vllm_omni_mxfp4_demo.trained import WAN

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(main.os, "sched_getaffinity", lambda pid: {0, 1})

    def engines(argv, trained):
        args = modes.build_parser().parse_args(argv)
        return main._engines(args, main.DemoRun(args, tmp_path, tmp_path, [], {}, trained=trained))

    count, env = engines([], WAN)  # the shipped trained model
    assert count == 2 and env["OMP_NUM_THREADS"] == "1" and env["PATH"] == main.os.environ["PATH"]
    assert engines(["--random-weights"], None)[0] == 2
    assert engines(["--model", str(tmp_path)], None) == (1, None)  # a real model: one engine, every core
    monkeypatch.setattr(main.os, "sched_getaffinity", lambda pid: set(range(8)))
    count, env = engines(["--engines", "3"], WAN)
    assert count == 3 and env["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's choice stands
    assert engines([], WAN) == (2, None)
