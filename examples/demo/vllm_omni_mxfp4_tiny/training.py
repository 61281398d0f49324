"""Training pieces for the task models (:mod:`.task`): what a trained tiny Wan2.2 is taught with.

Everything here computes what vLLM-Omni's Wan2.2 pipeline computes at inference, so that weights
trained with it load and run there unchanged:

- **Text.** :func:`task_tokenizer` is a word-level ``PreTrainedTokenizerFast`` over the task's
  vocabulary that ends every prompt with ``</s>`` as T5's tokenizer does; :func:`task_text_encoder`
  a seeded ``UMT5EncoderModel`` that stays frozen (the transformers' cross-attention learns to read
  it). :func:`prompt_embeddings` tokenizes to the pipeline's ``max_sequence_length`` (512), encodes
  with the attention mask, keeps each prompt's own tokens and zero-fills the rest, as
  ``encode_prompt`` does.
- **Cross-attention on the padded text, cheaply and exactly.** All 512 - n padding rows of a
  prompt are zero, so every one of them gives the same key and value. :func:`compact_text` keeps a
  prompt's n tokens and L - n of its padding rows, and gives each kept padding row the logit bias
  log((512 - n) / (L - n)): softmax over the L rows then weighs them exactly as softmax over the 512
  rows does. :class:`CompactCrossAttention` is diffusers' Wan cross-attention with that bias; it
  makes a training step several times cheaper and changes nothing the trained weights compute
  (checked against the full 512-row attention in the tests). :func:`compact_text_attention` lets a
  whole pipeline run on compact text the same way (the trained models' evaluation).
- **Flow matching.** :func:`flow_matching_loss` is the objective vLLM-Omni's flow-prediction
  schedulers invert: ``x_t = (1 - sigma) x_0 + sigma * noise``, timestep ``1000 * sigma``, target
  ``noise - x_0``; each expert of a two-expert pipeline is trained on its own side of the
  ``boundary_ratio`` (the high-noise ``transformer`` on ``sigma >= boundary_ratio``). Noise levels
  are drawn as the sampler visits them: uniform in the unshifted time, then through the pipeline's
  ``flow_shift`` (:func:`shifted_sigma`), so an expert learns most where inference spends its steps
  (with shift 5, half of a 10-step run is above sigma 0.875).
- **The loops.** :func:`train_vae` trains an ``AutoencoderKLWan`` on renders of the training prompts;
  :func:`latent_bank` encodes a fixed set of renders once; :func:`train_expert` trains one expert on
  it. Each is deterministic in its config's seed (same losses, same weights) and shows its loss in
  a tqdm bar. Training renders use seeds below :data:`TRAINING_SEEDS`.
- **Shared with the image model** (:mod:`.trained_flux`): :func:`image_batch` (still renders, as
  :func:`video_batch`), :class:`ExponentialAverage` (the weights' moving average both transformer
  loops end on), :func:`flow_matching_loss` and :func:`compact_text` (with FLUX's timestep scale and
  inputs, and its identical non-zero padding rows), :func:`cosine_learning_rate`, the task's
  vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .task import (
    TRAINING_SEEDS,
    ImagePrompt,
    VideoPrompt,
    image_prompts,
    render_image,
    render_video,
    video_prompts,
)

MAX_SEQUENCE_LENGTH = 512
"""The padded text length vLLM-Omni's Wan2.2 pipeline gives the transformer (``max_sequence_length``)."""

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")


def task_vocabulary() -> tuple[str, ...]:
    """The special tokens, then every word of every task prompt (video and image), sorted."""
    words = {w for p in (*video_prompts(), *image_prompts()) for w in p.text.split()}
    return SPECIAL_TOKENS + tuple(sorted(words))


def task_tokenizer(max_length: int = MAX_SEQUENCE_LENGTH) -> Any:
    """A word-level ``PreTrainedTokenizerFast`` over :func:`task_vocabulary` that appends ``</s>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocabulary = task_vocabulary()
    word_level = Tokenizer(
        models.WordLevel(vocab={w: i for i, w in enumerate(vocabulary)}, unk_token="<unk>")
    )
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", vocabulary.index("</s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=word_level,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=max_length,
    )


def task_text_encoder(config: dict[str, Any], seed: int) -> Any:
    """A ``UMT5EncoderModel`` from ``config`` (a ``UMT5Config``'s keys) with weights drawn from ``seed``."""
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return UMT5EncoderModel(UMT5Config(**config)).eval()


@torch.no_grad()
def prompt_embeddings(
    tokenizer: Any, text_encoder: Any, texts: Sequence[str], max_length: int = MAX_SEQUENCE_LENGTH
) -> torch.Tensor:
    """``(len(texts), max_length, d_model)``: each text's token states, zero past its own tokens."""
    tokens = tokenizer(
        list(texts),
        padding="max_length",
        max_length=max_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    states = text_encoder(tokens.input_ids, tokens.attention_mask).last_hidden_state
    keep = tokens.attention_mask.bool().unsqueeze(-1)
    return torch.where(keep, states, torch.zeros_like(states))


def compact_text(
    embeddings: torch.Tensor, length: int | None = None, tokens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` rows of padded ``embeddings`` and the logit bias ``(B, length)`` that
    makes attention over them equal attention over all rows (module docstring).

    ``tokens`` (``(B,)``): how many leading rows of each prompt are its own; by default the rows that
    are not zero (Wan2.2's pipeline zero-fills the padding). Exact only when every padding row of a
    prompt holds the same values. Every prompt must leave at least one padding row among the kept
    ones; ``length`` None keeps exactly one past the longest prompt."""
    batch, total, _ = embeddings.shape
    if tokens is None:
        tokens = own_rows(embeddings)
    if length is None:
        length = int(tokens.max()) + 1
    _require_padding_row(tokens, length, "compact_text", "use a length above the longest prompt")
    return embeddings[:, :length].contiguous(), padding_bias(tokens, length, total)


def own_rows(embeddings: torch.Tensor) -> torch.Tensor:
    """``(B,)``: how many leading rows of each prompt's padded ``embeddings`` are its own: the rows
    that are not zero (Wan2.2's pipeline zero-fills the padding)."""
    return (embeddings.abs().amax(dim=-1) > 0).sum(dim=1)


def _require_padding_row(tokens: torch.Tensor, length: int, caller: str, remedy: str) -> None:
    """Refuse prompts of ``tokens`` own rows that leave no padding row among ``length`` kept rows:
    nothing would stand for their padding."""
    if int(tokens.max()) >= length:
        raise ValueError(
            f"{caller}: a prompt has {int(tokens.max())} tokens, which leaves no padding row among "
            f"the first {length}; {remedy}"
        )


def padding_bias(tokens: torch.Tensor, length: int, total: int) -> torch.Tensor:
    """``(B, length)``: the logit bias of :func:`compact_text` for prompts of ``tokens`` own rows kept
    in ``length`` of their ``total`` rows: zero on a prompt's own rows, log((total - n) / (length - n))
    on each kept padding row."""
    rows = torch.arange(length).unsqueeze(0)
    n = tokens.unsqueeze(1).to(torch.float64)
    weight = torch.log((total - n) / (length - n))
    return torch.where(rows >= tokens.unsqueeze(1), weight, torch.zeros_like(weight)).to(torch.float32)


class CompactCrossAttention:
    """diffusers ``WanAttnProcessor`` for a text-only cross-attention, with the logit bias of
    :func:`compact_text` (set :attr:`bias` to ``(B, L)`` before each forward)."""

    def __init__(self) -> None:
        self.bias: torch.Tensor | None = None

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: Any = None,
    ) -> torch.Tensor:
        if self.bias is None or encoder_hidden_states is None:
            raise RuntimeError(
                "CompactCrossAttention: set .bias and pass the compact text before the forward"
            )
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(encoder_hidden_states))
        value = attn.to_v(encoder_hidden_states)
        query, key, value = (t.unflatten(2, (attn.heads, -1)).transpose(1, 2) for t in (query, key, value))
        bias = self.bias[:, None, None, :].to(query.dtype)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias)
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def use_compact_cross_attention(transformer: Any) -> CompactCrossAttention:
    """Route every block's cross-attention (``attn2``) of a diffusers ``WanTransformer3DModel``
    through one :class:`CompactCrossAttention`, which is returned (set its bias per batch)."""
    processor = CompactCrossAttention()
    for block in transformer.blocks:
        block.attn2.set_processor(processor)
    return processor


@contextmanager
def compact_text_attention(
    transformers: Sequence[Any], total: int = MAX_SEQUENCE_LENGTH
) -> Iterator[CompactCrossAttention]:
    """Within the block, every given ``WanTransformer3DModel`` reads compact text (:func:`compact_text`
    rows, zero padding rows) as if it were the prompt's ``total`` padded rows: its cross-attention goes
    through one :class:`CompactCrossAttention` whose bias each forward sets from the text it is given.
    A pipeline handed compact ``prompt_embeds`` then computes what it computes from the full text,
    without projecting hundreds of identical padding rows a step. The processors are restored after."""
    processor = CompactCrossAttention()

    def set_bias(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        text = kwargs.get("encoder_hidden_states")
        if text is None:
            raise RuntimeError(
                "compact_text_attention: the transformer was called without encoder_hidden_states= as a "
                "keyword (diffusers' WanPipeline passes it so)"
            )
        tokens = own_rows(text)
        _require_padding_row(
            tokens, text.shape[1], "compact_text_attention", "give it compact_text's rows, which keep one"
        )
        processor.bias = padding_bias(tokens, text.shape[1], total)

    saved = [(block.attn2, block.attn2.processor) for t in transformers for block in t.blocks]
    hooks = [t.register_forward_pre_hook(set_bias, with_kwargs=True) for t in transformers]
    try:
        for attention, _ in saved:
            attention.set_processor(processor)
        yield processor
    finally:
        for hook in hooks:
            hook.remove()
        for attention, original in saved:
            attention.set_processor(original)


def flow_matching_loss(
    transformer: Any,
    x0: torch.Tensor,
    sigma: torch.Tensor,
    noise: torch.Tensor,
    text: torch.Tensor,
    *,
    timestep_scale: float = 1000.0,
    **inputs: Any,
) -> torch.Tensor:
    """Mean squared error of the transformer's flow prediction at noise level ``sigma`` (per sample).

    The transformer gets ``timestep_scale * sigma`` as its timestep (diffusers' Wan transformer
    takes 1000 * sigma; its FLUX transformer takes sigma and scales it itself: 1.0) and ``inputs`` as
    further keyword arguments (FLUX's pooled text, position ids, guidance)."""
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    noisy = (1 - s) * x0 + s * noise
    predicted = transformer(
        hidden_states=noisy,
        timestep=sigma * timestep_scale,
        encoder_hidden_states=text,
        return_dict=False,
        **inputs,
    )[0]
    return F.mse_loss(predicted.float(), (noise - x0).float())


def shifted_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The flow scheduler's time shift, ``shift * u / (1 + (shift - 1) * u)``: unshifted time ``u``
    in [0, 1] to the noise level the sampler runs at."""
    return shift * u / (1 + (shift - 1) * u)


def unshifted_time(sigma: float, shift: float) -> float:
    """The inverse of :func:`shifted_sigma`."""
    return sigma / (shift - (shift - 1) * sigma)


def cosine_learning_rate(step: int, steps: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``floor * peak`` at ``steps``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min((step - warmup) / max(steps - warmup, 1), 1.0)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def adamw(parameters: Any, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """The optimizer of every training loop: AdamW with its multi-tensor (``foreach``) update, which
    on the CPU torch leaves off by default. It computes what the per-tensor loop computes, bit for
    bit, in one call per step instead of a Python loop over ~180 parameters: the step of a tiny
    Wan2.2 expert spent ~7 % of its time in that loop."""
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay, foreach=True)


def _optimizer_step(
    optimizer: torch.optim.Optimizer, parameters: Any, loss: torch.Tensor, lr: float
) -> float:
    """One step of both loops at learning rate ``lr``: gradients clipped to norm 1; returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(parameters, 1.0, foreach=True)
    optimizer.step()
    return float(loss.detach())


class ExponentialAverage:
    """The exponential moving average of a module's parameters over training steps: decay ``decay``,
    ramped up over the first steps (``min(decay, (1 + step) / (10 + step))``), so that early weights
    are soon forgotten. After a short run the average samples better than the last step's weights."""

    def __init__(self, parameters: Sequence[torch.nn.Parameter], decay: float) -> None:
        self.decay = decay
        self.average = [p.detach().clone() for p in parameters]

    @torch.no_grad()
    def update(self, parameters: Sequence[torch.nn.Parameter], step: int) -> None:
        """Fold ``parameters`` as they are after training step ``step`` (from 0) into the average."""
        decay = min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(self.average, list(parameters), 1 - decay)

    @torch.no_grad()
    def copy_to(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        """Set ``parameters`` to the average."""
        for kept, parameter in zip(self.average, parameters):
            parameter.copy_(kept)


def image_batch(
    rng: np.random.Generator, prompts: Sequence[ImagePrompt], batch: int, *, height: int, width: int
) -> tuple[torch.Tensor, np.ndarray]:
    """``batch`` renders of prompts and seeds drawn from ``rng``: ``(B, 3, H, W)`` in [-1, 1] (the
    VAE's range) and the index of each one's prompt in ``prompts``."""
    which = rng.integers(len(prompts), size=batch)
    seeds = rng.integers(TRAINING_SEEDS, size=batch)
    images = np.stack(
        [render_image(prompts[i], int(s), height=height, width=width) for i, s in zip(which, seeds)]
    )
    return torch.from_numpy(images).permute(0, 3, 1, 2) * 2 - 1, which


def video_batch(
    rng: np.random.Generator,
    prompts: Sequence[VideoPrompt],
    batch: int,
    *,
    frames: int,
    height: int,
    width: int,
) -> tuple[torch.Tensor, np.ndarray]:
    """``batch`` renders of prompts and seeds drawn from ``rng``: ``(B, 3, F, H, W)`` in [-1, 1] (the
    VAE's range) and the index of each one's prompt in ``prompts``."""
    which = rng.integers(len(prompts), size=batch)
    seeds = rng.integers(TRAINING_SEEDS, size=batch)
    videos = np.stack(
        [
            render_video(prompts[i], int(s), frames=frames, height=height, width=width)
            for i, s in zip(which, seeds)
        ]
    )
    return torch.from_numpy(videos).permute(0, 4, 1, 2, 3) * 2 - 1, which


def keep_current_frame_taps(module: Any) -> int:
    """Make every causal convolution of ``module`` see only the current frame: its taps on past frames
    are zeroed and a gradient mask keeps them zero while training. Returns how many were changed.

    Applied to the VAE's decoder (:func:`train_vae`): each frame is then decoded from its own latent
    alone, so the first frame, which a causal decoder would decode with no history, decodes as every
    other frame does, and a latent the transformer got slightly wrong spoils only its own frame."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    changed = 0
    for conv in module.modules():
        if isinstance(conv, WanCausalConv3d) and conv.kernel_size[0] > 1:
            mask = torch.zeros_like(conv.weight)
            mask[:, :, -1] = 1
            with torch.no_grad():
                conv.weight.mul_(mask)
            conv.weight.register_hook(lambda grad, mask=mask: grad * mask)
            changed += 1
    return changed


@dataclass(frozen=True)
class VaeTraining:
    """How the VAE is trained: as an autoencoder on renders of the training prompts.

    The loss is the mean squared error per pixel, with the pixels that differ from the first frame's
    corner (the shape, not the background) weighted ``shape_weight`` times, plus ``latent_l2`` times
    the mean square of the latents (keeps them near unit scale), plus ``previous_frame`` times the
    same error of a second decoder that reads each frame's *previous* frame from its latent (training
    only; it is not saved). The encoder is causal, so each latent can carry where the shape was a
    frame earlier: with that head it must, and motion becomes something each latent frame shows
    rather than a relation the transformer has to find between frames."""

    steps: int
    batch: int = 8
    lr: float = 2e-3
    warmup: int = 20
    shape_weight: float = 10.0
    latent_l2: float = 1e-4
    previous_frame: float = 0.5
    frames: int = 5
    height: int = 32
    width: int = 32
    seed: int = 0


def _decode_frames(vae: Any, decoder: Any, latents: torch.Tensor) -> torch.Tensor:
    """Every frame of ``latents`` through ``decoder`` (one of the VAE's, per-frame) in one call: what
    ``vae.decode`` computes frame by frame, without its clamp."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    out = decoder(vae.post_quant_conv(latents))
    patch = vae.config.patch_size
    return unpatchify(out, patch_size=patch) if patch else out


def _weighted_error(decoded: torch.Tensor, videos: torch.Tensor, shape_weight: float) -> torch.Tensor:
    shape = ((videos - videos[:, :, :1, :1, :1]).abs().sum(dim=1, keepdim=True) > 0.1).float()
    return (((decoded - videos) ** 2) * (1 + (shape_weight - 1) * shape)).mean()


def train_vae(vae: Any, config: VaeTraining, *, progress: bool = True) -> list[float]:
    """Train ``vae`` (a diffusers ``AutoencoderKLWan`` with no temporal compression) in place, its
    decoder per-frame (:func:`keep_current_frame_taps`); returns each step's loss (:class:`VaeTraining`).

    Deterministic in ``config.seed``: the same config gives the same losses and weights."""
    import copy

    if vae.config.scale_factor_temporal != 1 or any(vae.config.temperal_downsample):
        raise ValueError(
            "train_vae: the VAE compresses time (scale_factor_temporal "
            f"{vae.config.scale_factor_temporal}, temperal_downsample {vae.config.temperal_downsample}); "
            "the task's VAE keeps one latent frame per frame"
        )
    torch.manual_seed(config.seed)
    keep_current_frame_taps(vae.decoder)
    previous = copy.deepcopy(vae.decoder)  # the training-only head: the frame before, from each latent
    keep_current_frame_taps(previous)
    parameters = [*vae.parameters(), *previous.parameters()]
    rng = np.random.default_rng([config.seed, 10])
    prompts = video_prompts(held_out=False)
    optimizer = adamw(parameters, config.lr, 0.0)
    vae.train()
    losses: list[float] = []
    bar = tqdm(range(config.steps), desc="vae", disable=not progress)
    for step in bar:
        videos, _ = video_batch(
            rng, prompts, config.batch, frames=config.frames, height=config.height, width=config.width
        )
        latents = vae.encode(videos).latent_dist.mean
        loss = _weighted_error(_decode_frames(vae, vae.decoder, latents), videos, config.shape_weight)
        before = _decode_frames(vae, previous, latents)[:, :, 1:]
        loss = loss + config.previous_frame * _weighted_error(before, videos[:, :, :-1], config.shape_weight)
        loss = loss + config.latent_l2 * (latents**2).mean()
        lr = cosine_learning_rate(step, config.steps, config.lr, config.warmup)
        losses.append(_optimizer_step(optimizer, parameters, loss, lr))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    vae.eval()
    return losses


@dataclass(frozen=True)
class LatentBank:
    """Training videos encoded once: normalized latents (the pipeline's ``(z - mean) / std``), the
    prompt index of each, and the per-channel ``mean``/``std`` that go into the VAE's config."""

    latents: torch.Tensor
    prompts: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def encode_frames(vae: Any, videos: torch.Tensor) -> torch.Tensor:
    """The encoder mean of ``videos`` ``(B, 3, F, H, W)``, one latent frame per frame, for any F.

    ``AutoencoderKLWan`` encodes the first frame, then chunks of four, and drops frames that do not
    fill a chunk; the videos are padded with copies of their last frame to 4k + 1 frames and the
    first F latent frames kept, which the causal encoder computes from the first F frames alone."""
    frames = videos.shape[2]
    padded = 4 * ((frames + 2) // 4) + 1
    if padded > frames:
        videos = torch.cat([videos, videos[:, :, -1:].expand(-1, -1, padded - frames, -1, -1)], dim=2)
    return vae.encode(videos).latent_dist.mean[:, :, :frames]


@torch.no_grad()
def latent_bank(
    vae: Any, count: int, *, seed: int, frames: int, height: int = 32, width: int = 32, chunk: int = 64
) -> LatentBank:
    """``count`` renders of training prompts (seeds from ``seed``) through ``vae``'s encoder mean."""
    rng = np.random.default_rng([seed, 11])
    prompts = video_prompts(held_out=False)
    latents, indices = [], []
    for start in tqdm(range(0, count, chunk), desc="encode", leave=False):
        videos, which = video_batch(
            rng, prompts, min(chunk, count - start), frames=frames, height=height, width=width
        )
        latents.append(encode_frames(vae, videos))
        indices.append(torch.from_numpy(which))
    z = torch.cat(latents)
    mean, std = z.mean(dim=(0, 2, 3, 4)), z.std(dim=(0, 2, 3, 4))
    shape = (1, -1, 1, 1, 1)
    return LatentBank((z - mean.view(shape)) / std.view(shape), torch.cat(indices), mean, std)


@dataclass(frozen=True)
class ExpertTraining:
    """How one expert is trained with :func:`flow_matching_loss` on noise levels in
    ``[sigma_low, sigma_high)``, drawn uniform in the unshifted time and mapped through
    :func:`shifted_sigma` with ``shift`` (1: uniform in sigma); ``drop_prompt`` of the samples see the
    empty prompt instead (the unconditional branch classifier-free guidance needs). The tiny FLUX's
    single transformer is trained with one too, over every noise level (:mod:`.trained_flux`)."""

    steps: int
    sigma_low: float
    sigma_high: float
    batch: int = 16
    lr: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.01
    drop_prompt: float = 0.1
    shift: float = 1.0
    ema: float = 0.0
    seed: int = 0


def init_transformer(transformer: Any) -> None:
    """Start a ``WanTransformer3DModel`` as DiT's adaLN-Zero does: every block an identity and the
    output zero (the gates, the time-conditioned modulation, the cross-attention's output projection
    and ``proj_out`` zero; other Linears Xavier-uniform with zero bias). The modulation then grows
    from the time embedding as training needs it; from diffusers' default initialization the same
    expert learned colour, shape and motion several hundred steps later."""
    from torch import nn

    for module in transformer.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
    zero = [transformer.condition_embedder.time_proj, transformer.proj_out]
    zero += [block.attn2.to_out[0] for block in transformer.blocks]
    with torch.no_grad():
        for module in zero:
            module.weight.zero_()
            module.bias.zero_()
        for table in [transformer.scale_shift_table, *(b.scale_shift_table for b in transformer.blocks)]:
            table.zero_()


def train_expert(
    transformer: Any,
    bank: LatentBank,
    text: torch.Tensor,
    bias: torch.Tensor,
    config: ExpertTraining,
    *,
    progress: bool = True,
    name: str = "expert",
) -> list[float]:
    """Train ``transformer`` (a diffusers ``WanTransformer3DModel``) in place; returns each step's loss.

    With ``config.ema`` the transformer ends with the exponential moving average of its weights over
    the steps (decay ``ema``, ramped up over the first steps), which samples better than the last
    step's weights after a short run.

    ``text``/``bias``: :func:`compact_text` of the prompt embeddings of the training prompts in
    ``video_prompts(held_out=False)`` order, then the empty prompt as the last row."""
    empty = text.shape[0] - 1
    if empty != len(video_prompts(held_out=False)):
        raise ValueError(
            f"train_expert: text has {text.shape[0]} rows; expected one per training prompt "
            f"({len(video_prompts(held_out=False))}) and the empty prompt last"
        )
    processor = use_compact_cross_attention(transformer)
    generator = torch.Generator().manual_seed(config.seed)
    u_low, u_high = (unshifted_time(s, config.shift) for s in (config.sigma_low, config.sigma_high))
    optimizer = adamw(transformer.parameters(), config.lr, config.weight_decay)
    parameters = list(transformer.parameters())
    average = ExponentialAverage(parameters, config.ema) if config.ema else None
    transformer.train()
    losses: list[float] = []
    bar = tqdm(range(config.steps), desc=name, disable=not progress)
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
        processor.bias = bias[rows]
        lr = cosine_learning_rate(step, config.steps, config.lr, config.warmup)
        loss = flow_matching_loss(transformer, x0, sigma, noise, text[rows])
        losses.append(_optimizer_step(optimizer, parameters, loss, lr))
        if average is not None:
            average.update(parameters, step)
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    if average is not None:
        average.copy_to(parameters)
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    for block in transformer.blocks:  # the full-text attention the pipeline runs
        block.attn2.set_processor(WanAttnProcessor())
    transformer.eval()
    return losses
