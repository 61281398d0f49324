"""The trained tiny FLUX.1-dev (vllm_omni_mxfp4_tiny/trained_flux.py): its quick recipe is
deterministic and writes the layout vLLM-Omni's FluxPipeline loads; the compact text it is trained on
computes what the pipeline's 512 padded T5 tokens give; the shipped copy is what its manifest records,
generates images the detector reads as prompted in diffusers (through the engine: the demo's tests,
tests/demo/test_demo_e2e.py); a changed file is named."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from vllm_omni_mxfp4_demo.accuracy import IMAGE
from vllm_omni_mxfp4_tiny import trained_flux, training_command
from vllm_omni_mxfp4_tiny.detect import prompt_accuracy
from vllm_omni_mxfp4_tiny.task import TRAINING_SEEDS, image_prompts
from vllm_omni_mxfp4_tiny.training import MAX_SEQUENCE_LENGTH, task_vocabulary


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained_flux")
    return [
        trained_flux.train_flux(root / name, trained_flux.quick_recipe(), progress=False) for name in "ab"
    ], root


def test_training_command_is_deterministic(quick_runs):
    (first, second), _ = quick_runs
    assert first["metrics"]["final_loss"] == second["metrics"]["final_loss"]
    assert first["sha256"] == second["sha256"]
    assert {
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/model.safetensors",
        "text_encoder_2/model.safetensors",
        "tokenizer/tokenizer.json",
        "tokenizer_2/tokenizer.json",
    } <= set(first["sha256"])


def test_pipeline_has_the_layout_the_quantizers_need(quick_runs):
    """FLUX.1-dev's components and classes, every weight in BF16, K >= 256 on every Linear of the
    transformer but x_embedder (the 4 x 16 packed latent channels), a single-stream block (the blocks
    vLLM-Omni quantizes), a 2x VAE whose normalization the latent bank set."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    (manifest, _), root = quick_runs
    directory = root / "a"
    assert manifest["configs"]["transformer"] == trained_flux.TRANSFORMER_CONFIG
    index = json.loads((directory / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    assert index["tokenizer"][1] == "CLIPTokenizer" and index["tokenizer_2"][1] in {
        "T5Tokenizer",
        "T5TokenizerFast",
    }
    for name in ("transformer/diffusion_pytorch_model", "vae/diffusion_pytorch_model", "text_encoder/model"):
        with safe_open(str(directory / f"{name}.safetensors"), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}, name  # noqa: SIM118
    transformer = FluxTransformer2DModel.from_pretrained(directory / "transformer")
    assert transformer.config.guidance_embeds and len(transformer.single_transformer_blocks) >= 1
    linears = {n: m for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    small = {n: m.in_features for n, m in linears.items() if m.in_features < 256}
    assert small == {"x_embedder": 4 * trained_flux.VAE_CONFIG["latent_channels"]}
    vae = json.loads((directory / "vae" / "config.json").read_text())
    assert vae["scaling_factor"] > 0 and vae["scaling_factor"] != 0.3611  # set from the bank, not FLUX's
    pipeline = FluxPipeline.from_pretrained(directory)
    assert pipeline.vae_scale_factor == 2  # 2 ** (len(block_out_channels) - 1), as vLLM-Omni derives it
    evaluation = manifest["metrics"]["diffusers_fp32_eval"]
    assert min(evaluation["seeds"]) >= TRAINING_SEEDS
    assert evaluation["seen_prompts"]["images"] == evaluation["held_out_prompts"]["images"] == 2


def test_tokenizers_read_every_task_word_as_one_token(tmp_path):
    """Saved and loaded with the classes vLLM-Omni's FluxPipeline loads."""
    from transformers import CLIPTokenizer, T5TokenizerFast

    trained_flux.clip_tokenizer().save_pretrained(tmp_path / "clip")
    trained_flux.t5_tokenizer().save_pretrained(tmp_path / "t5")
    clip = CLIPTokenizer.from_pretrained(tmp_path / "clip")
    t5 = T5TokenizerFast.from_pretrained(tmp_path / "t5")
    words = [w for w in task_vocabulary() if not w.startswith("<") and w != "</s>"]
    clip_ids = {w: clip(w, add_special_tokens=False).input_ids for w in words}
    t5_ids = {w: t5(w, add_special_tokens=False).input_ids for w in words}
    assert all(len(ids) == 1 for ids in clip_ids.values()), clip_ids
    assert all(len(ids) == 1 for ids in t5_ids.values()), t5_ids
    assert (
        len({ids[0] for ids in clip_ids.values()}) == len({ids[0] for ids in t5_ids.values()}) == len(words)
    )
    longest = max((p.text for p in image_prompts()), key=lambda t: len(t.split()))
    assert len(clip(longest).input_ids) <= trained_flux.CLIP_MAX_LENGTH
    assert t5(longest).input_ids[-1] == t5.eos_token_id
    assert t5("a purple square", add_special_tokens=False).input_ids[1] == t5.unk_token_id


@pytest.fixture(scope="module")
def random_pipeline():
    """The shipped layout with its random initial weights (the transformer not zero-initialized)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    tokenizer, tokenizer_2 = trained_flux.clip_tokenizer(), trained_flux.t5_tokenizer()
    torch.manual_seed(0)
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**trained_flux.scheduler_config()),
        text_encoder=trained_flux.clip_text_encoder(tokenizer, 0),
        tokenizer=tokenizer,
        text_encoder_2=trained_flux.t5_text_encoder(tokenizer_2, 1),
        tokenizer_2=tokenizer_2,
        vae=AutoencoderKL(**trained_flux.VAE_CONFIG).eval(),
        transformer=FluxTransformer2DModel(**trained_flux.TRANSFORMER_CONFIG).eval(),
    )


def test_compact_text_computes_what_the_pipelines_512_tokens_give(random_pipeline):
    """Training reads a prompt's own T5 tokens and one padding row with the log-count bias; the
    pipeline feeds all 512 rows, unmasked. The transformer's output must be the same."""
    pipeline = random_pipeline
    texts = [image_prompts()[17].text, ""]
    with torch.no_grad():
        full, pooled, _ = pipeline.encode_prompt(prompt=texts, prompt_2=None)
    assert full.shape[1] == MAX_SEQUENCE_LENGTH
    text = trained_flux.encode_text(pipeline, texts)
    assert text.states.shape[1] == len(texts[0].split()) + 2  # the words, </s>, one padding row
    tokens = trained_flux.image_tokens()
    latents = torch.randn(2, tokens, 64, generator=torch.Generator().manual_seed(1))
    common = {
        "hidden_states": latents,
        "pooled_projections": pooled,
        "timestep": torch.tensor([0.9, 0.3]),
        "img_ids": trained_flux.position_ids(tokens),
        "guidance": torch.full((2,), trained_flux.GUIDANCE),
        "return_dict": False,
    }
    transformer = pipeline.transformer
    with torch.no_grad():
        want = transformer(encoder_hidden_states=full, txt_ids=torch.zeros(full.shape[1], 3), **common)[0]
        compact_ids = torch.zeros(text.states.shape[1], 3)
        mask = trained_flux.joint_mask(text.bias, tokens)
        got = transformer(
            encoder_hidden_states=text.states,
            txt_ids=compact_ids,
            joint_attention_kwargs={"attention_mask": mask},
            **common,
        )[0]
        unbiased = transformer(encoder_hidden_states=text.states, txt_ids=compact_ids, **common)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert float((unbiased - want).abs().max()) > 1e-3  # without the bias it is another attention


def test_a_t5_with_a_position_bias_is_refused(random_pipeline):
    """With a relative position bias the padding states differ and the compact text is not exact."""
    import copy

    pipeline = copy.copy(random_pipeline)
    pipeline.text_encoder_2 = copy.deepcopy(random_pipeline.text_encoder_2)
    bias = pipeline.text_encoder_2.encoder.block[0].layer[0].SelfAttention.relative_attention_bias
    with torch.no_grad():
        bias.weight.normal_(generator=torch.Generator().manual_seed(0))
    with pytest.raises(
        ValueError, match=r"T5 padding states of a prompt differ .* zero relative position bias"
    ):
        trained_flux.encode_text(pipeline, [image_prompts()[0].text])


def test_training_noise_levels_are_the_ones_the_pipelines_sampler_visits():
    """FluxPipeline's scheduler for 64 image tokens (dynamic shifting) is the reference."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from vllm_omni_mxfp4_tiny.training import shifted_sigma

    config = trained_flux.scheduler_config()
    sampler = FlowMatchEulerDiscreteScheduler(**config)
    steps = 20
    mu = calculate_shift(
        trained_flux.image_tokens(),
        config["base_image_seq_len"],
        config["max_image_seq_len"],
        config["base_shift"],
        config["max_shift"],
    )
    sampler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    unshifted = torch.from_numpy(np.linspace(1.0, 1 / steps, steps))
    torch.testing.assert_close(
        shifted_sigma(unshifted, trained_flux.sampler_shift()).float(), sampler.sigmas[:-1].float()
    )
    assert trained_flux.image_tokens() == (trained_flux.HEIGHT // 4) * (trained_flux.WIDTH // 4)


def test_a_changed_missing_or_extra_file_is_named(quick_runs, tmp_path):
    _, root = quick_runs
    copy = tmp_path / "pipeline"
    shutil.copytree(root / "a", copy)
    training_command.verify_manifest(copy)
    weights = copy / "transformer" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError) as error:
        training_command.verify_manifest(copy)
    assert "transformer/diffusion_pytorch_model.safetensors: SHA-256" in str(error.value)
    assert f"rerun `{trained_flux.COMMAND}`" in str(error.value)
    (copy / "tokenizer_2" / "tokenizer.json").unlink()
    (copy / "notes.txt").write_text("x")
    with pytest.raises(ValueError) as error:
        training_command.verify_manifest(copy)
    assert "tokenizer_2/tokenizer.json: missing" in str(error.value)
    assert "notes.txt: not in the manifest" in str(error.value)


@pytest.mark.skipif(training_command.pinned_kernels() is None, reason="CPU kernels are pinned on x86-64 only")
def test_the_command_pins_threads_and_cpu_kernels_and_summarizes(tmp_path):
    """The command line, in a process of its own as a user runs it: it computes with THREADS threads
    and the pinned CPU kernels whatever the environment offers (either would train other weights),
    lets a kernel variable the user set win and warns that the weights will differ, records what ran,
    and ends with a summary a person can read."""
    out = tmp_path / "cli"
    env = {k: v for k, v in os.environ.items() if k not in training_command.CPU_KERNELS}
    env |= {"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "default"}  # the user's choice of kernels
    command = [sys.executable, "-m", "vllm_omni_mxfp4_tiny.trained_flux", "--quick", "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((out / training_command.MANIFEST).read_text())
    assert manifest["threads"] == training_command.THREADS
    pinned = training_command.pinned_kernels()
    assert manifest["cpu_kernels"] == {"aten": "DEFAULT", "onednn_max_isa": pinned["onednn_max_isa"]}
    assert "the weights will not match the shipped ones bit for bit" in done.stderr
    assert f"trained pipeline: {out}" in done.stdout
    assert (
        "prompt accuracy, seen prompts x seeds [1000000]: " in done.stdout and " of 2 images; " in done.stdout
    )
    assert f"SHA-256 in {out / training_command.MANIFEST}" in done.stdout


def test_quick_flag_refuses_to_overwrite_the_shipped_weights(capsys):
    with pytest.raises(SystemExit):
        trained_flux.main(["--quick"])
    assert "--quick would overwrite the shipped weights" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the shipped pipeline


def test_the_shipped_pipeline_is_what_its_manifest_records():
    """Every file byte for byte as the training command wrote it, within the 4.5 MB budget, the
    configs of this module, a recorded prompt accuracy on seen prompts and >= 3 unseen seeds, and the
    pinned CPU kernels they were computed with."""
    manifest = training_command.verify_manifest(trained_flux.SHIPPED)
    size = sum((trained_flux.SHIPPED / name).stat().st_size for name in manifest["sha256"])
    size += (trained_flux.SHIPPED / training_command.MANIFEST).stat().st_size
    assert size <= 4.5e6, size
    assert manifest["command"] == trained_flux.COMMAND
    assert manifest["configs"]["transformer"] == trained_flux.TRANSFORMER_CONFIG
    assert manifest["configs"]["text_encoder"] == trained_flux.CLIP_CONFIG
    assert manifest["configs"]["text_encoder_2"] == trained_flux.T5_CONFIG
    evaluation = manifest["metrics"]["diffusers_fp32_eval"]
    assert len(evaluation["seeds"]) >= 3 and min(evaluation["seeds"]) >= TRAINING_SEEDS
    assert evaluation["steps"] == trained_flux.EVAL_STEPS
    assert evaluation["guidance_scale"] == trained_flux.GUIDANCE
    assert evaluation["seen_prompts"]["images"] == len(image_prompts(held_out=False)) * len(
        evaluation["seeds"]
    )
    assert evaluation["seen_prompts"]["prompt_accuracy"] >= SHIPPED_BAR
    # computed with the CPU kernels the command pins, so any x86-64 machine can train them again
    assert manifest["cpu_kernels"] == {"aten": "AVX2", "onednn_max_isa": "AVX2"}


#: The seen-prompt accuracy the shipped model measured (manifest), which the tests hold it to.
SHIPPED_BAR = 0.9


def test_the_shipped_pipeline_generates_what_it_is_prompted_in_diffusers():
    """diffusers' own FluxPipeline, FP32, the evaluation's settings, the seen prompts of the demo's
    request set on the first unseen seed."""
    from diffusers import FluxPipeline

    pipeline = FluxPipeline.from_pretrained(trained_flux.SHIPPED, dtype=torch.float32)
    requests = [(p, s) for p, s, held in IMAGE.requests(1) if not held]
    images = trained_flux.generate(
        pipeline,
        [p.text for p, _ in requests],
        TRAINING_SEEDS,
        trained_flux.EVAL_STEPS,
        trained_flux.GUIDANCE,
    )
    assert images.shape == (len(requests), trained_flux.HEIGHT, trained_flux.WIDTH, 3)
    accuracy = prompt_accuracy([(p, image) for (p, _), image in zip(requests, images)])
    assert accuracy.value >= 0.8, accuracy
