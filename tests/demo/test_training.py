"""The training pieces (vllm_omni_mxfp4_tiny/training.py): text as the Wan2.2 pipeline encodes it,
and the compact cross-attention that must compute what the full 512-row attention computes."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from vllm_omni_mxfp4_tiny import task, training
from vllm_omni_mxfp4_tiny.wan import TEXT_ENCODER_CONFIG

# the random tiny Wan's text encoder, over the task's vocabulary
TEXT_ENCODER = {**TEXT_ENCODER_CONFIG, "vocab_size": len(training.task_vocabulary())}


@pytest.fixture(scope="module")
def text_parts():
    return training.task_tokenizer(), training.task_text_encoder(TEXT_ENCODER, seed=0)


def test_tokenizer_knows_every_task_word_and_ends_with_eos(text_parts):
    tokenizer, _ = text_parts
    prompt = task.VideoPrompt("red", "bar", "left", "slowly", "black")
    ids = tokenizer(prompt.text).input_ids
    assert len(ids) == len(prompt.text.split()) + 1 and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.unk_token_id not in ids
    assert tokenizer("a purple bar").input_ids[1] == tokenizer.unk_token_id
    image = task.ImagePrompt("blue", "square", "top left", "gray")
    assert tokenizer.unk_token_id not in tokenizer(image.text).input_ids


def test_prompt_embeddings_are_zero_past_each_prompts_tokens(text_parts):
    tokenizer, encoder = text_parts
    texts = [task.video_prompts()[0].text, "", "a red square"]
    embeds = training.prompt_embeddings(tokenizer, encoder, texts)
    assert embeds.shape == (3, training.MAX_SEQUENCE_LENGTH, TEXT_ENCODER["d_model"])
    lengths = [len(t.split()) + 1 for t in texts]
    for row, n in zip(embeds, lengths):
        assert bool((row[:n].abs().amax(-1) > 0).all()) and float(row[n:].abs().max()) == 0.0
    # a prompt's states do not depend on what else is in the batch (the mask hides the padding)
    alone = training.prompt_embeddings(tokenizer, encoder, texts[2:])
    torch.testing.assert_close(alone[0], embeds[2], rtol=1e-5, atol=1e-6)


def test_compact_text_refuses_a_length_with_no_padding_row(text_parts):
    tokenizer, encoder = text_parts
    embeds = training.prompt_embeddings(tokenizer, encoder, [task.video_prompts()[0].text])
    with pytest.raises(
        ValueError, match=r"a prompt has 11 tokens, which leaves no padding row among the first 11"
    ):
        training.compact_text(embeds, 11)
    _, bias = training.compact_text(embeds, 12)
    assert bias[0, :11].abs().max() == 0 and math.isclose(float(bias[0, 11]), math.log(501), rel_tol=1e-6)
    # by default: exactly one padding row past the longest prompt
    text, default_bias = training.compact_text(embeds)
    assert text.shape[1] == 12 and torch.equal(default_bias, bias)


def test_compact_cross_attention_computes_what_the_full_padded_text_gives(text_parts):
    """The trained weights are used with 512 text rows; training with 12 rows plus the bias must
    give the same transformer output (and so the same gradients)."""
    from diffusers import WanTransformer3DModel

    tokenizer, encoder = text_parts
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        patch_size=[1, 2, 2],
        num_attention_heads=2,
        attention_head_dim=32,
        in_channels=4,
        out_channels=4,
        text_dim=TEXT_ENCODER["d_model"],
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()
    texts = [task.video_prompts()[5].text, ""]
    full = training.prompt_embeddings(tokenizer, encoder, texts)
    latents = torch.randn(2, 4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    timestep = torch.tensor([900.0, 250.0])
    with torch.no_grad():
        want = transformer(
            hidden_states=latents, timestep=timestep, encoder_hidden_states=full, return_dict=False
        )[0]
        processor = training.use_compact_cross_attention(transformer)
        text, processor.bias = training.compact_text(full, 12)
        got = transformer(
            hidden_states=latents, timestep=timestep, encoder_hidden_states=text, return_dict=False
        )[0]
        # without the bias the 12 rows are a different attention: the check can fail
        processor.bias = torch.zeros_like(processor.bias)
        unbiased = transformer(
            hidden_states=latents, timestep=timestep, encoder_hidden_states=text, return_dict=False
        )[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert float((unbiased - want).abs().max()) > 1e-3


def test_cosine_learning_rate_warms_up_then_decays_to_its_floor():
    lr = [training.cosine_learning_rate(s, 100, 1e-3, warmup=10) for s in range(101)]
    assert lr[0] == pytest.approx(1e-4) and lr[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lr[10:], lr[11:]))
    assert lr[100] == pytest.approx(1e-4)


def test_shifted_noise_levels_are_the_ones_the_pipelines_sampler_visits():
    # diffusers' UniPC scheduler with flow sigmas and shift 5 (what vLLM-Omni's Wan2.2 samples with)
    # is the independent reference for the time shift the experts are trained on.
    from vllm_omni_mxfp4_tiny.trained_wan import scheduler

    sampler = scheduler()
    sampler.set_timesteps(10)
    unshifted = torch.linspace(1, 0, 11)[:-1]
    shifted = training.shifted_sigma(unshifted, sampler.config.flow_shift)
    torch.testing.assert_close(shifted, sampler.sigmas[:-1].float(), atol=4e-3, rtol=0)
    for sigma in (0.0, 0.3, 0.875, 1.0):
        assert training.shifted_sigma(
            torch.tensor(training.unshifted_time(sigma, 5.0)), 5.0
        ) == pytest.approx(sigma)
    assert training.shifted_sigma(unshifted, 1.0).equal(unshifted)


def _tiny_vae(**overrides):
    """The trained VAE's layout at toy size: a 2x2 patch, no downsampling stage, no temporal compression."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    from vllm_omni_mxfp4_tiny.trained_wan import VAE_CONFIG

    config = {**VAE_CONFIG, "base_dim": 4, "z_dim": 4}  # the shipped layout, narrower: seconds to train
    return AutoencoderKLWan(**{**config, **overrides})


VAE_TRAINING = training.VaeTraining(steps=10, batch=2, frames=5, height=24, width=24, warmup=1, lr=3e-3)


@pytest.fixture(scope="module")
def trained_vae():
    vae = _tiny_vae()
    return vae, training.train_vae(vae, VAE_TRAINING, progress=False)


def test_vae_training_is_deterministic_and_learns(trained_vae):
    first, losses = trained_vae
    second = _tiny_vae()
    assert losses == training.train_vae(second, VAE_TRAINING, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert sum(losses[-3:]) < sum(losses[:3])
    other = training.train_vae(_tiny_vae(), dataclasses.replace(VAE_TRAINING, seed=1), progress=False)
    assert other != losses


def test_the_trained_decoder_decodes_each_frame_from_its_own_latent(trained_vae):
    """The pipeline decodes frame by frame through a causal cache; a per-frame decoder gives each frame
    from its own latent alone, the same as one call over all frames (how training decodes)."""
    vae, _ = trained_vae
    latents = torch.randn(2, 4, 5, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        piecewise = vae.decode(latents).sample
        at_once = training._decode_frames(vae, vae.decoder, latents).clamp(-1, 1)
        changed = latents.clone()
        changed[:, :, 0] += 1.0
        after_change = vae.decode(changed).sample
    torch.testing.assert_close(at_once, piecewise, rtol=1e-4, atol=1e-5)
    assert torch.equal(after_change[:, :, 1:], piecewise[:, :, 1:])
    assert not torch.equal(after_change[:, :, 0], piecewise[:, :, 0])
    # the encoder stays causal: its latents of a frame see the frames before it
    videos = torch.rand(1, 3, 5, 24, 24) * 2 - 1
    moved = videos.clone()
    moved[:, :, 0] = -moved[:, :, 0]
    with torch.no_grad():
        assert not torch.equal(
            training.encode_frames(vae, videos)[:, :, 1], training.encode_frames(vae, moved)[:, :, 1]
        )


def test_a_vae_that_compresses_time_is_refused():
    vae = _tiny_vae(
        dim_mult=[1, 2], temperal_downsample=[True], scale_factor_spatial=4, scale_factor_temporal=2
    )
    with pytest.raises(ValueError, match=r"the VAE compresses time \(scale_factor_temporal 2"):
        training.train_vae(vae, VAE_TRAINING, progress=False)


def test_every_frame_is_encoded_whatever_the_count(trained_vae):
    """AutoencoderKLWan drops frames past the last 4k + 1; encode_frames keeps them, and its first
    frames' latents are the causal encoder's latents of those frames alone."""
    vae, _ = trained_vae
    videos = torch.rand(2, 3, 6, 24, 24, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.no_grad():
        six = training.encode_frames(vae, videos)
        five = vae.encode(videos[:, :, :5]).latent_dist.mean
        dropped = vae.encode(videos).latent_dist.mean
    assert six.shape[2] == 6 and dropped.shape[2] == 5
    torch.testing.assert_close(six[:, :, :5], five, rtol=1e-5, atol=1e-6)


def _expert(**overrides):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(1)
    config = {
        "patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 4,
        "out_channels": 4, "text_dim": TEXT_ENCODER["d_model"], "freq_dim": 32, "ffn_dim": 32, "num_layers": 1,
        "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 32,
    }  # fmt: skip
    return WanTransformer3DModel(**{**config, **overrides})


def test_init_starts_every_block_as_identity_and_the_output_at_zero(text_parts):
    tokenizer, encoder = text_parts
    transformer = _expert(num_layers=2)
    training.init_transformer(transformer)
    text = training.prompt_embeddings(tokenizer, encoder, [task.video_prompts()[0].text])
    latents = torch.randn(1, 4, 2, 8, 8)
    seen = []
    handle = transformer.blocks[0].register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
    with torch.no_grad():
        out = transformer(
            hidden_states=latents, timestep=torch.tensor([500.0]), encoder_hidden_states=text
        ).sample
    handle.remove()
    assert float(out.abs().max()) == 0.0
    block_in, block_out = seen[0]
    assert torch.equal(block_in, block_out)


@pytest.fixture(scope="module")
def bank_and_text(text_parts, trained_vae):
    tokenizer, encoder = text_parts
    vae, _ = trained_vae
    bank = training.latent_bank(vae, 6, seed=0, frames=6, height=24, width=24)
    texts = [p.text for p in task.video_prompts(held_out=False)] + [""]
    text, bias = training.compact_text(training.prompt_embeddings(tokenizer, encoder, texts), 12)
    return bank, text, bias


def test_the_latent_bank_holds_every_frame_normalized(bank_and_text):
    bank, _, _ = bank_and_text
    assert bank.latents.shape == (6, 4, 6, 12, 12) and bank.prompts.shape == (6,)
    torch.testing.assert_close(bank.latents.mean(dim=(0, 2, 3, 4)), torch.zeros(4), atol=1e-5, rtol=0)


def test_expert_training_is_deterministic_and_keeps_the_pipelines_attention(bank_and_text):
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    bank, text, bias = bank_and_text
    config = training.ExpertTraining(
        steps=3, sigma_low=0.875, sigma_high=1.0, batch=2, warmup=1, drop_prompt=0.5
    )
    first, second = _expert(), _expert()
    losses = training.train_expert(first, bank, text, bias, config, progress=False)
    assert losses == training.train_expert(second, bank, text, bias, config, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert all(isinstance(block.attn2.processor, WanAttnProcessor) for block in first.blocks)
    with pytest.raises(ValueError, match=r"text has 3 rows; expected one per training prompt \(160\)"):
        training.train_expert(_expert(), bank, text[:3], bias[:3], config, progress=False)


def test_the_moving_average_is_what_an_expert_ends_with(bank_and_text):
    """With ema the transformer ends on the average of its weights over the steps: the same run's
    losses, other weights than the last step's, and the average of those with the start."""
    bank, text, bias = bank_and_text
    plain = training.ExpertTraining(steps=4, sigma_low=0.0, sigma_high=1.0, batch=2, warmup=1, lr=1e-2)
    averaged = dataclasses.replace(plain, ema=0.5)
    start, last, smooth = _expert(), _expert(), _expert()
    assert training.train_expert(last, bank, text, bias, plain, progress=False) == training.train_expert(
        smooth, bank, text, bias, averaged, progress=False
    )
    for a, b, c in zip(start.parameters(), last.parameters(), smooth.parameters()):
        if not torch.equal(a, b):  # a trained weight: the average is neither the start nor the end
            assert not torch.equal(c, b) and not torch.equal(c, a)


def test_exponential_average_ramps_up_then_keeps_its_decay():
    """(1 + step) / (10 + step) for the first steps, then ``decay``: the average after two updates
    towards 1 from 0 is 1 - 0.1 * 2/11, and copy_to writes it into the parameters."""
    parameter = torch.nn.Parameter(torch.zeros(3))
    average = training.ExponentialAverage([parameter], decay=0.99)
    with torch.no_grad():
        parameter.fill_(1.0)
    average.update([parameter], step=0)  # decay 1/10
    torch.testing.assert_close(average.average[0], torch.full((3,), 0.9))
    average.update([parameter], step=1)  # decay 2/11
    torch.testing.assert_close(average.average[0], torch.full((3,), 1 - 0.1 * 2 / 11))
    average.decay = 0.5
    average.update([parameter], step=100)  # min(0.5, 101/110)
    torch.testing.assert_close(average.average[0], torch.full((3,), 1 - 0.05 * 2 / 11))
    average.copy_to([parameter])
    torch.testing.assert_close(parameter.detach(), average.average[0])


def test_the_training_step_gives_the_per_tensor_loops_weights_bit_for_bit():
    """The loops' multi-tensor updates (AdamW, gradient clipping, the moving average) change only how
    fast a step runs: after steps that clip, their weights and average equal those of torch's
    per-tensor AdamW, clipping and lerp exactly (the shipped weights were trained with the loops)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    loops = [model, copy.deepcopy(model)]
    data = [(torch.randn(16, 64), torch.randn(16, 32) * 5) for _ in range(6)]

    fast, slow = (list(m.parameters()) for m in loops)
    fast_opt = training.adamw(fast, 1e-2, 0.01)
    slow_opt = torch.optim.AdamW(slow, lr=1e-2, weight_decay=0.01, foreach=False)
    fast_avg = training.ExponentialAverage(fast, decay=0.9)
    slow_avg = [p.detach().clone() for p in slow]
    norms = []
    for step, (x, y) in enumerate(data):
        training._optimizer_step(fast_opt, fast, torch.nn.functional.mse_loss(loops[0](x), y), 1e-2)
        fast_avg.update(fast, step)
        slow_opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(loops[1](x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(slow, 1.0, foreach=False)))
        slow_opt.step()
        with torch.no_grad():
            for kept, p in zip(slow_avg, slow):
                kept.lerp_(p, 1 - min(0.9, (1 + step) / (10 + step)))
    assert max(norms) > 1.0  # clipping did something
    for a, b in zip([*fast, *fast_avg.average], [*slow, *slow_avg]):
        assert torch.equal(a, b)


def test_image_batches_are_seeded_renders_of_their_prompts():
    import numpy as np

    from vllm_omni_mxfp4_tiny.detect import read

    prompts = task.image_prompts(held_out=False)
    first = training.image_batch(np.random.default_rng(3), prompts, 6, height=32, width=32)
    again = training.image_batch(np.random.default_rng(3), prompts, 6, height=32, width=32)
    assert torch.equal(first[0], again[0]) and (first[1] == again[1]).all()
    images, which = first
    assert images.shape == (6, 3, 32, 32) and float(images.min()) >= -1 and float(images.max()) <= 1
    for image, index in zip(images, which):
        reading = read(((image + 1) / 2).permute(1, 2, 0).numpy())
        prompt = prompts[index]
        assert (reading.colour, reading.shape, reading.position) == (
            prompt.colour,
            prompt.shape,
            prompt.position,
        )
