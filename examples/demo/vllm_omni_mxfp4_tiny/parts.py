"""Parts every tiny pipeline builder needs: seeded random modules and offline tokenizers.

The tiny pipelines have random weights, so their tokenizers only have to be the classes the
pipelines load (``CLIPTokenizer``, ``T5TokenizerFast``, ``Qwen2Tokenizer``, ``ByT5Tokenizer``) with
a vocabulary small enough for a tiny text encoder; they are built in memory, no hub download.
The byte-level BPE ones hold the 256 byte symbols and no merges (one token per byte of text, so a
chat template of a few hundred characters still gives a few hundred tokens, as the pipelines that
drop a template prefix expect); the Unigram one (T5) holds the lower-case letters and the space.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""Qwen2 / Qwen2.5-VL / Qwen3 chat and vision markers the pipelines' prompt templates use."""


def seeded(seed: int, factory: Callable[[], T]) -> T:
    """``factory()`` with torch's CPU generator seeded to ``seed``, the caller's RNG state untouched."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def bf16(module: Any) -> Any:
    """``module`` in eval mode with every tensor stored in BF16, as released transformers are.

    ``torch.nn.Module.to`` rather than diffusers' own ``.to``, which warns that some modules should
    compute in FP32: that is the loader's concern at run time, not the checkpoint's.
    """
    import torch

    return torch.nn.Module.to(module.eval(), torch.bfloat16)


def _byte_vocab(specials: tuple[str, ...]) -> dict[str, int]:
    from tokenizers import pre_tokenizers

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet()) + list(specials)
    return {symbol: index for index, symbol in enumerate(symbols)}


def qwen2_tokenizer(max_length: int) -> Any:
    """A ``Qwen2Tokenizer`` (byte-level BPE, 256 + 7 tokens) with the Qwen special tokens and a
    minimal Qwen chat template (:data:`QWEN_CHAT_TEMPLATE`)."""
    from transformers import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer(vocab=_byte_vocab(QWEN_SPECIAL_TOKENS), merges=[], model_max_length=max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:])})
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def clip_tokenizer(max_length: int = 77) -> Any:
    """A ``CLIPTokenizer`` (byte-level BPE, 256 + 2 tokens) with CLIP's start and end tokens."""
    from transformers import CLIPTokenizer

    vocab = _byte_vocab(("<|startoftext|>", "<|endoftext|>"))
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def t5_tokenizer(max_length: int = 512) -> Any:
    """A ``T5TokenizerFast`` (Unigram over letters and space, plus T5's 100 sentinel ids)."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(letter, -2.0) for letter in "abcdefghijklmnopqrstuvwxyz"]
    return T5TokenizerFast(vocab=pieces, model_max_length=max_length)


def vocab_size(tokenizer: Any) -> int:
    """How many ids ``tokenizer`` can produce (the text encoder's ``vocab_size`` must cover them)."""
    return len(tokenizer)


QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The Qwen chat markup (no tools, no thinking block): what ``apply_chat_template`` needs to run."""


def byt5_tokenizer() -> Any:
    """A ``ByT5Tokenizer`` (bytes: no vocabulary file to build)."""
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


def qwen3_text_encoder(config: dict[str, Any], max_length: int, seed: int) -> tuple[Any, Any]:
    """(tokenizer, BF16 ``Qwen3ForCausalLM``) of a Qwen3 text encoder (FLUX.2-klein's, Z-Image's):
    the in-memory Qwen2 tokenizer and a model of ``config`` whose vocabulary and special ids are the
    tokenizer's, its random weights drawn under ``seed``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = qwen2_tokenizer(max_length)
    qwen3 = Qwen3Config(
        **config,
        vocab_size=vocab_size(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return tokenizer, seeded(seed, lambda: bf16(Qwen3ForCausalLM(qwen3)))
