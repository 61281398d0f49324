"""The trained tiny FLUX.1-dev text-to-image pipeline: what it is, how it is trained, where it is shipped.

:func:`train_flux` trains a diffusers ``FluxPipeline`` on the still-image task (:mod:`.task`: a
colour, a shape, a position and a background; the held-out colour x shape pairs never shown) from
fixed seeds, in three stages:

1. its ``AutoencoderKL`` (FLUX's 16 latent channels) as an autoencoder on renders of the training
   prompts, with 2x spatial compression (two ``block_out_channels``: vLLM-Omni and diffusers both
   derive the scale factor as ``2 ** (len(block_out_channels) - 1)``), so a 32x32 image is 16x16
   latents and, packed 2x2 as FLUX packs them, 64 image tokens;
2. a bank of training renders encoded once; the mean and standard deviation of its latents become
   the VAE's ``shift_factor`` and ``1 / scaling_factor``, which the pipeline uses to normalize;
3. the ``FluxTransformer2DModel`` (``guidance_embeds=True``, FLUX.1-dev's layout) trained with flow
   matching in that normalized space on the noise levels the pipeline's scheduler visits for 64
   tokens, started as DiT's adaLN-Zero, ending on the moving average of its weights. It reads the
   pipeline's own text encoders through their own tokenizer classes: a ``CLIPTokenizer`` and a
   ``T5TokenizerFast`` over the task's words (one token per word, :func:`clip_tokenizer`,
   :func:`t5_tokenizer`), a seeded ``CLIPTextModel`` and ``T5EncoderModel`` that stay frozen. Its
   guidance embedding is fed :data:`BASE_GUIDANCE` (1: no guidance), and one sample in ten sees the
   empty prompt (the unconditional flow);
4. guidance distillation, as FLUX.1-dev is distilled (:class:`GuidanceDistillation`): from a frozen
   copy of itself, the transformer learns to predict, for a guidance g fed to its guidance
   embedding, what classifier-free guidance at scale g computes from two passes.

**Guidance.** In FLUX.1-dev ``guidance_scale`` is an input of the transformer (its guidance
embedding), not classifier-free guidance, and that is all vLLM-Omni's pipeline does with it unless a
request also sets ``true_cfg_scale``; diffusers' ``FluxPipeline`` the same. Stage 4 makes this
model work that way: one pass at ``guidance_scale`` g gives what two passes of true classifier-free
guidance at scale g give the stage-3 model, whose conditional flow alone draws blurred triangles
(read as squares). Requests pass ``guidance_scale`` = :data:`GUIDANCE` (chosen on seeds the
evaluation does not use, :data:`GUIDANCE`'s docstring) and no ``true_cfg_scale``.

**The text, cheaply and exactly.** FLUX gives the transformer all 512 T5 states of a prompt,
padding included, with no attention mask, in one joint attention with the image tokens (all text
positions are 0 for RoPE). The T5 encoder's relative position bias is zero
(:func:`t5_text_encoder`), so every padding token of a prompt has the same state, and stays the same
through every block: attention over its 512 - n copies equals attention over a few of them whose
logits get log((512 - n) / kept) (:func:`.training.compact_text`). Training feeds the transformer a
prompt's n tokens and a few padding rows with that bias as an attention mask (:func:`joint_mask`),
about 16 text tokens instead of 512; inference runs the plain pipeline on all 512 (checked equal in
the tests).

**Size.** Every Linear of the transformer has K >= 256 (inner dim 256, text and time dims 256) but
``x_embedder``, whose K is the 4 x 16 packed latent channels (64, as in FLUX.1-dev; vLLM-Omni builds
it as a plain Linear, never quantized). The whole directory must stay under 4.5 MB, which leaves
room for one transformer block of inner dim 256 and no more: a double-stream block is 36 x 256^2
parameters (4.7 MB in BF16) on its own, a single-stream block 15 x 256^2 (2 MB). vLLM-Omni hands its
quantization config to the single-stream blocks only (the double-stream blocks get it only for
pre-quantized checkpoints), so the model is FLUX's embedders and output layers around one
single-stream block (``num_layers=0``, ``num_single_layers=1``): its fused QKV, ``proj_mlp`` and
``proj_out`` (K = 256, 256, 1280) are the Linears the MXFP4 methods run on. Every weight is stored in
BF16; the evaluation computes in FP32.

Sizes of a request: 32x32 pixels (divisible by ``vae_scale_factor * 2`` = 4), :data:`EVAL_STEPS`
steps, ``guidance_scale`` :data:`GUIDANCE`, no negative prompt; the output is one RGB image.

    python -m vllm_omni_mxfp4_tiny.trained_flux [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import training_command
from .training_command import (
    MANIFEST,
    StageClock,
    accuracy_record,
    final_loss,
    library_versions,
    recipe_record,
    write_manifest,
)

logger = logging.getLogger(__name__)

SHIPPED = Path(__file__).parent / "trained" / "flux1_dev_t2i"
"""Where the demo distribution carries the trained pipeline (package data): the command's default output."""

COMMAND = "python -m vllm_omni_mxfp4_tiny.trained_flux"
HEIGHT = WIDTH = 32
TEXT_DIM = 256
CLIP_MAX_LENGTH = 16
"""The CLIP tokenizer's ``model_max_length`` (and CLIP's position table): the pipelines pad CLIP's
input to it; the longest task prompt is 13 tokens with CLIP's start and end tokens."""
BASE_GUIDANCE = 1.0
"""The guidance embedding's input while the transformer learns the flow (stage 3): 1, no guidance."""
GUIDANCE = 3.0
"""The ``guidance_scale`` of the evaluation and of requests (distilled guidance, module docstring)."""
EVAL_STEPS = 20
"""Denoising steps of the evaluation (and of the demo's runs of the trained pipeline)."""

TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 0,
    "num_single_layers": 1,
    "attention_head_dim": 32,
    "num_attention_heads": 8,  # 8 x 32: 87.5 % where 4 x 64 reached 79 % and 16 x 16 81 %, same steps
    "joint_attention_dim": TEXT_DIM,
    "pooled_projection_dim": TEXT_DIM,
    "guidance_embeds": True,
    "axes_dims_rope": [4, 14, 14],  # FLUX's split of a head: a little for the unused axis 0
}
"""diffusers ``FluxTransformer2DModel`` config (1.6 M parameters; module docstring)."""

CLIP_CONFIG: dict[str, Any] = {
    "hidden_size": TEXT_DIM,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "max_position_embeddings": CLIP_MAX_LENGTH,
    "projection_dim": TEXT_DIM,
}
"""transformers ``CLIPTextConfig`` keys (vocabulary size and special ids come from the tokenizer);
its pooled output is the transformer's ``pooled_projections``, so its width is 256."""

T5_CONFIG: dict[str, Any] = {
    "d_model": TEXT_DIM,
    "d_kv": 16,
    "d_ff": 32,
    "num_layers": 1,
    "num_heads": 2,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
}
"""transformers ``T5Config`` keys of the T5 v1.1 encoder (vocabulary size and ids from the tokenizer)."""

VAE_CONFIG: dict[str, Any] = {
    "down_block_types": ["DownEncoderBlock2D"] * 2,
    "up_block_types": ["UpDecoderBlock2D"] * 2,
    "block_out_channels": [16, 32],
    "layers_per_block": 1,
    "latent_channels": 16,
    "norm_num_groups": 8,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": False,
}
"""diffusers ``AutoencoderKL`` config: FLUX's 16 latent channels, 2x compression (no quant convs, as
FLUX's VAE); ``scaling_factor`` and ``shift_factor`` are set from the latent bank."""


def scheduler_config() -> dict[str, Any]:
    """FLUX.1-dev's ``FlowMatchEulerDiscreteScheduler`` config (the random tiny FLUX's, :mod:`.flux`)."""
    from .flux import SCHEDULER_CONFIG

    return dict(SCHEDULER_CONFIG)


def image_tokens(height: int = HEIGHT, width: int = WIDTH) -> int:
    """Packed image tokens of a ``height`` x ``width`` image: 2x VAE, then 2x2 latent patches."""
    scale = 2 ** (len(VAE_CONFIG["block_out_channels"]) - 1) * 2
    return (height // scale) * (width // scale)


def sampler_shift(tokens: int | None = None) -> float:
    """``exp(mu)``: the time shift FLUX's pipeline applies for ``tokens`` image tokens (dynamic
    shifting, ``mu`` linear in the token count), as :func:`.training.shifted_sigma`'s ``shift``."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    config = scheduler_config()
    mu = calculate_shift(
        image_tokens() if tokens is None else tokens,
        config["base_image_seq_len"],
        config["max_image_seq_len"],
        config["base_shift"],
        config["max_shift"],
    )
    return math.exp(mu)


@dataclass(frozen=True)
class ImageVaeTraining:
    """How the ``AutoencoderKL`` is trained: as an autoencoder on renders of the training prompts,
    the mean squared error per pixel with the shape's pixels (those that differ from the corner's
    background) weighted ``shape_weight`` times, plus ``latent_l2`` times the mean square of the
    latents (keeps them near unit scale)."""

    steps: int
    batch: int = 16
    lr: float = 2e-3
    warmup: int = 20
    shape_weight: float = 10.0
    latent_l2: float = 1e-4
    seed: int = 0


@dataclass(frozen=True)
class GuidanceDistillation:
    """How the guidance embedding is taught classifier-free guidance (FLUX.1-dev's guidance
    distillation). Each step draws a guidance g uniformly from ``[low, high]`` per sample; a frozen
    copy of the transformer (the teacher, fed :data:`BASE_GUIDANCE`) predicts the flows v_c of the
    prompt and v_u of the empty prompt; the transformer, fed g, regresses v_u + g (v_c - v_u), with
    gradients clipped and the learning rate warmed up and decayed as in the other stages, ending on
    the moving average of its weights. Noise levels and samples are drawn as in stage 3 (``shift``)."""

    steps: int
    batch: int = 64
    lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.01
    low: float = 1.0
    high: float = 4.0
    shift: float = 1.0
    ema: float = 0.99
    seed: int = 3


@dataclass(frozen=True)
class FluxRecipe:
    """Everything that decides the trained weights (the manifest records it)."""

    vae: ImageVaeTraining
    transformer: Any  # training.ExpertTraining over every noise level
    distill: GuidanceDistillation
    base_guidance: float = BASE_GUIDANCE
    bank_size: int = 4096
    bank_seed: int = 1
    text_seed: int = 0
    transformer_seed: int = 1
    vae_seed: int = 0
    eval_seeds: tuple[int, ...] = (1_000_000, 1_000_001, 1_000_002)
    eval_steps: int = EVAL_STEPS
    eval_guidance: float = GUIDANCE
    eval_prompts: int | None = None  # None: every seen and every held-out prompt


def default_recipe() -> FluxRecipe:
    """The recipe the command trains by default."""
    from .training import ExpertTraining

    return FluxRecipe(
        vae=ImageVaeTraining(steps=400),
        transformer=ExpertTraining(
            steps=3000, sigma_low=0.0, sigma_high=1.0, batch=64, lr=1e-3, shift=sampler_shift(), ema=0.998
        ),
        distill=GuidanceDistillation(steps=500, shift=sampler_shift()),
    )


def quick_recipe() -> FluxRecipe:
    """A few steps of every stage: the whole command in well under a minute (tests, smoke runs)."""
    from .training import ExpertTraining

    return FluxRecipe(
        vae=ImageVaeTraining(steps=3, batch=4),
        transformer=ExpertTraining(
            steps=4, sigma_low=0.0, sigma_high=1.0, batch=4, lr=1e-3, shift=sampler_shift(), ema=0.9
        ),
        distill=GuidanceDistillation(steps=3, batch=4, warmup=1, shift=sampler_shift(), ema=0.9),
        bank_size=16,
        eval_seeds=(1_000_000,),
        eval_steps=2,
        eval_prompts=2,
    )


def _words() -> list[str]:
    from .training import SPECIAL_TOKENS, task_vocabulary

    return [w for w in task_vocabulary() if w not in SPECIAL_TOKENS]


def clip_tokenizer() -> Any:
    """A ``CLIPTokenizer`` (the class FLUX's pipelines load) that reads every task word as one token.

    CLIP's tokenizer is byte-pair encoding: a word starts as its characters (the last one marked
    ``</w>``) and merges join adjacent pieces, the lowest-ranked present pair first. The merges are
    built word by word: while a word does not come out as one piece, the merge of its first two
    pieces is appended. A merge appended later ranks below every earlier one, so it never changes
    how an earlier word is merged (every step of that word had an earlier merge to apply)."""
    from transformers import CLIPTokenizer

    def encode(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
        while True:
            found = [(ranks[pair], i) for i, pair in enumerate(zip(symbols, symbols[1:])) if pair in ranks]
            if not found:
                return symbols
            _, i = min(found)
            symbols = [*symbols[:i], symbols[i] + symbols[i + 1], *symbols[i + 2 :]]

    vocabulary = ["<|startoftext|>", "<|endoftext|>"]
    ranks: dict[tuple[str, str], int] = {}
    for word in _words():
        symbols = [*word[:-1], word[-1] + "</w>"]
        vocabulary += [s for s in dict.fromkeys(symbols) if s not in vocabulary]
        while len(pieces := encode(symbols, ranks)) > 1:
            ranks[(pieces[0], pieces[1])] = len(ranks)
            if pieces[0] + pieces[1] not in vocabulary:
                vocabulary.append(pieces[0] + pieces[1])
    return CLIPTokenizer(
        vocab={s: i for i, s in enumerate(vocabulary)},
        merges=list(ranks),
        model_max_length=CLIP_MAX_LENGTH,
    )


def t5_tokenizer() -> Any:
    """A ``T5TokenizerFast`` (the class FLUX's pipelines load) whose Unigram pieces are the task's
    words: one token per word, ``</s>`` appended, no sentinel tokens."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("\u2581" + w, -1.0) for w in _words()]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)


def clip_text_encoder(tokenizer: Any, seed: int) -> Any:
    """A ``CLIPTextModel`` of :data:`CLIP_CONFIG` over ``tokenizer``'s ids, weights drawn from ``seed``."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        **CLIP_CONFIG,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return _seeded(seed, lambda: CLIPTextModel(config).eval())


def t5_text_encoder(tokenizer: Any, seed: int) -> Any:
    """A ``T5EncoderModel`` of :data:`T5_CONFIG` over ``tokenizer``'s ids, weights drawn from ``seed``,
    with a zero relative position bias: FLUX encodes 512 tokens with no attention mask, and with no
    position bias every padding token of a prompt gets the same state (module docstring)."""
    import torch
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        **T5_CONFIG,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    model = _seeded(seed, lambda: T5EncoderModel(config).eval())
    with torch.no_grad():
        model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.zero_()
    return model


def _seeded(seed: int, factory: Any) -> Any:
    from .parts import seeded

    return seeded(seed, factory)


def init_transformer(transformer: Any) -> None:
    """Start a ``FluxTransformer2DModel`` as DiT's adaLN-Zero does: every block an identity and the
    output zero (each block's and the output norm's modulation Linear and ``proj_out`` zero; the other
    Linears Xavier-uniform with zero bias). As with the tiny Wan (:func:`.training.init_transformer`),
    the modulation then grows from the time and text embedding as training needs it."""
    import torch
    from torch import nn

    for module in transformer.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
    zero = [transformer.norm_out.linear, transformer.proj_out]
    zero += [block.norm1.linear for block in transformer.transformer_blocks]
    zero += [block.norm1_context.linear for block in transformer.transformer_blocks]
    zero += [block.norm.linear for block in transformer.single_transformer_blocks]
    with torch.no_grad():
        for module in zero:
            module.weight.zero_()
            module.bias.zero_()


def joint_mask(bias: Any, image_tokens: int) -> Any:
    """The additive attention mask ``(B, 1, 1, L + image_tokens)`` of a compact text ``(B, L)`` bias
    (:func:`.training.compact_text`) for FLUX's joint attention, where the text comes first."""
    import torch

    zeros = torch.zeros(bias.shape[0], image_tokens, dtype=bias.dtype)
    return torch.cat([bias, zeros], dim=1)[:, None, None, :]


def position_ids(tokens: int) -> Any:
    """FLUX's RoPE ids of the packed image tokens (row and column of each 2x2 latent patch)."""
    import torch

    side = math.isqrt(tokens)
    ids = torch.zeros(side, side, 3)
    ids[..., 1] = torch.arange(side)[:, None]
    ids[..., 2] = torch.arange(side)[None, :]
    return ids.reshape(tokens, 3)


def pack(latents: Any) -> Any:
    """``(B, C, H, W)`` latents as FLUX's ``(B, H/2 * W/2, 4C)`` tokens (2x2 patches, channels first)."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)


def train_vae(vae: Any, config: ImageVaeTraining, *, progress: bool = True) -> list[float]:
    """Train ``vae`` (a diffusers ``AutoencoderKL``) in place on renders of the training prompts;
    returns each step's loss (:class:`ImageVaeTraining`). Deterministic in ``config.seed``."""
    import numpy as np
    import torch
    from tqdm import tqdm

    from .task import image_prompts
    from .training import _optimizer_step, _weighted_error, adamw, cosine_learning_rate, image_batch

    torch.manual_seed(config.seed)
    rng = np.random.default_rng([config.seed, 20])
    prompts = image_prompts(held_out=False)
    parameters = list(vae.parameters())
    optimizer = adamw(parameters, config.lr, 0.0)
    vae.train()
    losses: list[float] = []
    bar = tqdm(range(config.steps), desc="vae", disable=not progress)
    for step in bar:
        images, _ = image_batch(rng, prompts, config.batch, height=HEIGHT, width=WIDTH)
        latents = vae.encode(images).latent_dist.mean
        decoded = vae.decode(latents).sample
        loss = _weighted_error(decoded.unsqueeze(2), images.unsqueeze(2), config.shape_weight)
        loss = loss + config.latent_l2 * (latents**2).mean()
        lr = cosine_learning_rate(step, config.steps, config.lr, config.warmup)
        losses.append(_optimizer_step(optimizer, parameters, loss, lr))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    vae.eval()
    return losses


def latent_bank(vae: Any, count: int, *, seed: int, chunk: int = 256) -> Any:
    """``count`` renders of training prompts (seeds from ``seed``) through ``vae``'s encoder mean,
    normalized by their own mean and standard deviation and packed as FLUX's tokens
    (:class:`.training.LatentBank`; ``mean`` and ``std`` are scalars, as FLUX's VAE config holds them)."""
    import numpy as np
    import torch
    from tqdm import tqdm

    from .task import image_prompts
    from .training import LatentBank, image_batch

    rng = np.random.default_rng([seed, 21])
    prompts = image_prompts(held_out=False)
    latents, indices = [], []
    with torch.no_grad():
        for start in tqdm(range(0, count, chunk), desc="encode", leave=False):
            images, which = image_batch(rng, prompts, min(chunk, count - start), height=HEIGHT, width=WIDTH)
            latents.append(vae.encode(images).latent_dist.mean)
            indices.append(torch.from_numpy(which))
    z = torch.cat(latents)
    mean, std = z.mean(), z.std()
    return LatentBank(pack((z - mean) / std), torch.cat(indices), mean, std)


@dataclass(frozen=True)
class Text:
    """The training prompts (then the empty prompt, last) as the transformer reads them: the compact
    T5 states ``(P, L, 256)`` with their key bias ``(P, L)`` (:func:`.training.compact_text`) and
    CLIP's pooled output ``(P, 256)``, all computed by the pipeline's own ``encode_prompt``."""

    states: Any
    bias: Any
    pooled: Any


def encode_text(pipeline: Any, texts: Sequence[str], *, spare: int = 1) -> Text:
    """:class:`Text` of ``texts`` through ``pipeline`` (a diffusers ``FluxPipeline``): each prompt's
    own T5 tokens and ``spare`` of its identical padding rows kept. A ``ValueError`` if the padding
    rows are not all the same (the T5 encoder has a position bias: the compact text would not be exact)."""
    import torch

    from .training import MAX_SEQUENCE_LENGTH, compact_text

    with torch.no_grad():
        states, pooled, _ = pipeline.encode_prompt(
            prompt=list(texts), prompt_2=None, max_sequence_length=MAX_SEQUENCE_LENGTH
        )
    tokens = pipeline.tokenizer_2(
        list(texts), padding="max_length", max_length=MAX_SEQUENCE_LENGTH, return_tensors="pt"
    ).attention_mask.sum(dim=1)
    for row, n in zip(states, tokens.tolist()):
        spread = float((row[n:] - row[n]).abs().max())
        if spread > 1e-4 * float(row[n].abs().max()):
            raise ValueError(
                f"encode_text: the T5 padding states of a prompt differ by up to {spread:.3g}; the "
                "compact text needs them identical (a T5 encoder with zero relative position bias)"
            )
    compact, bias = compact_text(states, int(tokens.max()) + spare, tokens)
    return Text(compact.float(), bias, pooled.float())


def transformer_inputs(text: Text, rows: Any, tokens: int, guidance: Any) -> dict[str, Any]:
    """The keyword arguments of a diffusers ``FluxTransformer2DModel`` besides the latents and the
    timestep, for the prompts ``rows`` of ``text`` (compact, with its joint attention mask), ``tokens``
    image tokens and the guidance embedding's input ``guidance`` (per sample)."""
    import torch

    return {
        "encoder_hidden_states": text.states[rows],
        "pooled_projections": text.pooled[rows],
        "img_ids": position_ids(tokens),
        "txt_ids": torch.zeros(text.states.shape[1], 3),
        "guidance": guidance,
        "joint_attention_kwargs": {"attention_mask": joint_mask(text.bias[rows], tokens)},
    }


def _check_text(text: Text, caller: str) -> int:
    """The row of the empty prompt (the last), after checking there is one per training prompt before it."""
    from .task import image_prompts

    empty = text.states.shape[0] - 1
    if empty != len(image_prompts(held_out=False)):
        raise ValueError(
            f"{caller}: text has {text.states.shape[0]} rows; expected one per training prompt "
            f"({len(image_prompts(held_out=False))}) and the empty prompt last"
        )
    return empty


def train_transformer(
    transformer: Any,
    bank: Any,
    text: Text,
    config: Any,
    guidance: float,
    *,
    progress: bool = True,
) -> list[float]:
    """Train ``transformer`` (a diffusers ``FluxTransformer2DModel``) in place with flow matching on
    ``bank`` (:func:`latent_bank`) and ``text`` (:func:`encode_text` of the training prompts in
    ``image_prompts(held_out=False)`` order, then the empty prompt); returns each step's loss.

    ``config`` is a :class:`.training.ExpertTraining`: noise levels drawn as the pipeline's sampler
    visits them, ``drop_prompt`` of the samples on the empty prompt, the moving average of the weights
    at the end. The guidance embedding gets ``guidance`` in every step. Deterministic in ``config.seed``."""
    import torch
    from tqdm import tqdm

    from .training import (
        ExponentialAverage,
        _optimizer_step,
        adamw,
        cosine_learning_rate,
        flow_matching_loss,
        shifted_sigma,
        unshifted_time,
    )

    empty = _check_text(text, "train_transformer")
    tokens = bank.latents.shape[1]
    generator = torch.Generator().manual_seed(config.seed)
    u_low, u_high = (unshifted_time(s, config.shift) for s in (config.sigma_low, config.sigma_high))
    parameters = list(transformer.parameters())
    optimizer = adamw(parameters, config.lr, config.weight_decay)
    average = ExponentialAverage(parameters, config.ema) if config.ema else None
    transformer.train()
    losses: list[float] = []
    bar = tqdm(range(config.steps), desc="transformer", disable=not progress)
    for step in bar:
        pick = torch.randint(bank.latents.shape[0], (config.batch,), generator=generator)
        rows = bank.prompts[pick]
        dropped = torch.rand(config.batch, generator=generator) < config.drop_prompt
        rows = torch.where(dropped, torch.full_like(rows, empty), rows)
        sigma = shifted_sigma(
            u_low + (u_high - u_low) * torch.rand(config.batch, generator=generator), config.shift
        )
        x0 = bank.latents[pick]
        noise = torch.randn(x0.shape, generator=generator)
        inputs = transformer_inputs(text, rows, tokens, torch.full((config.batch,), guidance))
        loss = flow_matching_loss(
            transformer, x0, sigma, noise, inputs.pop("encoder_hidden_states"), timestep_scale=1.0, **inputs
        )
        lr = cosine_learning_rate(step, config.steps, config.lr, config.warmup)
        losses.append(_optimizer_step(optimizer, parameters, loss, lr))
        if average is not None:
            average.update(parameters, step)
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    if average is not None:
        average.copy_to(parameters)
    transformer.eval()
    return losses


def distill_guidance(
    transformer: Any,
    bank: Any,
    text: Text,
    config: GuidanceDistillation,
    base_guidance: float,
    *,
    progress: bool = True,
) -> list[float]:
    """Teach ``transformer`` (trained by :func:`train_transformer` at ``base_guidance``)
    classifier-free guidance through its guidance embedding, in place (:class:`GuidanceDistillation`);
    returns each step's loss. Deterministic in ``config.seed``."""
    import copy

    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from .training import ExponentialAverage, _optimizer_step, adamw, cosine_learning_rate, shifted_sigma

    empty = _check_text(text, "distill_guidance")
    tokens = bank.latents.shape[1]
    teacher = copy.deepcopy(transformer).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(config.seed)
    parameters = list(transformer.parameters())
    optimizer = adamw(parameters, config.lr, config.weight_decay)
    average = ExponentialAverage(parameters, config.ema) if config.ema else None
    transformer.train()
    losses: list[float] = []
    bar = tqdm(range(config.steps), desc="guidance distillation", disable=not progress)
    for step in bar:
        pick = torch.randint(bank.latents.shape[0], (config.batch,), generator=generator)
        rows = bank.prompts[pick]
        sigma = shifted_sigma(torch.rand(config.batch, generator=generator), config.shift)
        guidance = config.low + (config.high - config.low) * torch.rand(config.batch, generator=generator)
        x0 = bank.latents[pick]
        noise = torch.randn(x0.shape, generator=generator)
        noisy = (1 - sigma.view(-1, 1, 1)) * x0 + sigma.view(-1, 1, 1) * noise
        both = torch.cat([rows, torch.full_like(rows, empty)])
        with torch.no_grad():
            flows = teacher(
                hidden_states=torch.cat([noisy, noisy]),
                timestep=torch.cat([sigma, sigma]),
                return_dict=False,
                **transformer_inputs(text, both, tokens, torch.full((2 * config.batch,), base_guidance)),
            )[0]
            conditional, unconditional = flows.chunk(2)
            target = unconditional + guidance.view(-1, 1, 1) * (conditional - unconditional)
        predicted = transformer(
            hidden_states=noisy,
            timestep=sigma,
            return_dict=False,
            **transformer_inputs(text, rows, tokens, guidance),
        )[0]
        loss = F.mse_loss(predicted.float(), target.float())
        lr = cosine_learning_rate(step, config.steps, config.lr, config.warmup)
        losses.append(_optimizer_step(optimizer, parameters, loss, lr))
        if average is not None:
            average.update(parameters, step)
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    if average is not None:
        average.copy_to(parameters)
    transformer.eval()
    return losses


def generate(pipeline: Any, texts: Sequence[str], seed: int, steps: int, guidance: float) -> Any:
    """``pipeline``'s images of ``texts`` (a diffusers ``FluxPipeline``; one batch, each request
    seeded ``seed``, no negative prompt) as float32 ``(N, H, W, 3)`` in [0, 1]."""
    import torch

    pipeline.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return pipeline(
            prompt=list(texts),
            height=HEIGHT,
            width=WIDTH,
            num_inference_steps=steps,
            guidance_scale=guidance,
            generator=[torch.Generator().manual_seed(seed) for _ in texts],
            output_type="np",
        ).images


def evaluate(pipeline: Any, prompts: Sequence[Any], seeds: Sequence[int], steps: int, guidance: float) -> Any:
    """Prompt accuracy (:class:`.detect.Accuracy`) of ``pipeline`` over ``prompts`` x ``seeds``."""
    from tqdm import tqdm

    from .detect import prompt_accuracy

    pairs = []
    for seed in tqdm(seeds, desc="evaluate", leave=False):
        for start in range(0, len(prompts), 25):
            chunk = prompts[start : start + 25]
            pairs.extend(zip(chunk, generate(pipeline, [p.text for p in chunk], seed, steps, guidance)))
    return prompt_accuracy(pairs)


def _psnr(vae: Any) -> float:
    """The VAE's reconstruction PSNR (dB, pixels in [0, 1]) on 64 renders of training prompts with
    seeds training never used."""
    import numpy as np
    import torch

    from .task import TRAINING_SEEDS, image_prompts, render_image, sample_prompts

    prompts = sample_prompts(image_prompts(held_out=False), 64, seed=12)
    renders = [render_image(p, TRAINING_SEEDS + i, height=HEIGHT, width=WIDTH) for i, p in enumerate(prompts)]
    images = torch.from_numpy(np.stack(renders)).permute(0, 3, 1, 2) * 2 - 1
    with torch.no_grad():
        decoded = vae.decode(vae.encode(images).latent_dist.mean).sample.clamp(-1, 1)
    mse = float(((decoded - images) / 2).pow(2).mean())
    return 10 * math.log10(1 / mse)


def _eval_prompts(prompts: list[Any], recipe: FluxRecipe) -> list[Any]:
    from .task import sample_prompts

    count = recipe.eval_prompts
    return prompts if count is None or count >= len(prompts) else sample_prompts(prompts, count, seed=5)


def train_flux(out: Path, recipe: FluxRecipe | None = None, *, progress: bool = True) -> dict[str, Any]:
    """Train the pipeline of ``recipe`` (default :func:`default_recipe`), write it to ``out``
    (replacing what is there) with its manifest, and return the manifest."""
    import shutil

    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    from .task import image_prompts

    recipe = recipe or default_recipe()
    clock = StageClock()

    def stored(module: Any) -> Any:  # the weights as saved (BF16), computed in FP32
        return torch.nn.Module.to(torch.nn.Module.to(module, torch.bfloat16), torch.float32)

    tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer()
    text_encoder = stored(clip_text_encoder(tokenizer, recipe.text_seed))
    text_encoder_2 = stored(t5_text_encoder(tokenizer_2, recipe.text_seed + 1))
    vae = _seeded(recipe.vae_seed, lambda: AutoencoderKL(**VAE_CONFIG))
    clock.skip()
    vae_losses = train_vae(vae, recipe.vae, progress=progress)
    stored(vae)
    clock.lap("vae")
    bank = latent_bank(vae, recipe.bank_size, seed=recipe.bank_seed)
    vae.register_to_config(scaling_factor=float(1 / bank.std), shift_factor=float(bank.mean))
    clock.lap("latent_bank")

    transformer = _seeded(recipe.transformer_seed, lambda: FluxTransformer2DModel(**TRANSFORMER_CONFIG))
    init_transformer(transformer)
    pipeline = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_config()),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        vae=vae,
        transformer=transformer,
    )
    text = encode_text(pipeline, [p.text for p in image_prompts(held_out=False)] + [""])
    losses = train_transformer(
        transformer, bank, text, recipe.transformer, recipe.base_guidance, progress=progress
    )
    clock.lap("transformer")
    distill_losses = distill_guidance(
        transformer, bank, text, recipe.distill, recipe.base_guidance, progress=progress
    )
    stored(transformer)
    clock.lap("distill")

    seen, held_out = (
        evaluate(
            pipeline,
            _eval_prompts(image_prompts(held_out=held), recipe),
            recipe.eval_seeds,
            recipe.eval_steps,
            recipe.eval_guidance,
        )
        for held in (False, True)
    )
    clock.lap("evaluate")
    psnr = _psnr(vae)

    for module in (text_encoder, text_encoder_2, vae, transformer):  # stored in BF16
        torch.nn.Module.to(module, torch.bfloat16)
    if out.exists():
        shutil.rmtree(out)
    pipeline.save_pretrained(out, safe_serialization=True)
    manifest = {
        "model": "tiny FLUX.1-dev text-to-image trained on the synthetic still-image task (vllm_omni_mxfp4_tiny.task)",
        "command": COMMAND,
        "recipe": recipe_record(recipe),
        "configs": {
            "transformer": TRANSFORMER_CONFIG,
            "vae": {
                **VAE_CONFIG,
                "scaling_factor": vae.config.scaling_factor,
                "shift_factor": vae.config.shift_factor,
            },
            "text_encoder": CLIP_CONFIG,
            "text_encoder_2": T5_CONFIG,
            "scheduler": scheduler_config(),
        },
        "versions": library_versions(),
        "threads": torch.get_num_threads(),
        "cpu_kernels": training_command.cpu_kernels(),
        "seconds": clock.record(),
        "metrics": {
            "vae_psnr_db": round(psnr, 2),
            "final_loss": {
                "vae": final_loss(vae_losses),
                "transformer": final_loss(losses),
                "distill": final_loss(distill_losses),
            },
            "diffusers_fp32_eval": {
                "steps": recipe.eval_steps,
                "guidance_scale": recipe.eval_guidance,
                "true_cfg_scale": 1.0,
                "seeds": list(recipe.eval_seeds),
                "seen_prompts": accuracy_record(seen, "image"),
                "held_out_prompts": accuracy_record(held_out, "image"),
            },
        },
    }
    return write_manifest(out, manifest, MANIFEST)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m vllm_omni_mxfp4_tiny.trained_flux``."""
    return training_command.build_parser(
        COMMAND,
        "Train the tiny FLUX.1-dev text-to-image pipeline on the synthetic task, from fixed seeds.",
        SHIPPED,
    )


def main(argv: list[str] | None = None) -> int:
    """Train, write and summarize (the CLI)."""
    return training_command.main(
        build_parser(),
        argv,
        shipped=SHIPPED,
        train=train_flux,
        recipes=(default_recipe, quick_recipe),
        unit="image",
        manifest_name=MANIFEST,
    )


if __name__ == "__main__":
    sys.exit(main())
