"""The tiny pipelines' shared parts: offline tokenizers reload as the classes the pipelines load, and
the cache helper builds once, atomically."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_omni_mxfp4_tiny import cache, parts

TEXT = "<|im_start|>user\na red bird<|im_end|>\n"


@pytest.mark.parametrize(
    ("make", "loader"),
    [
        (lambda: parts.qwen2_tokenizer(64), "Qwen2Tokenizer"),
        (lambda: parts.qwen2_tokenizer(64), "Qwen2TokenizerFast"),
        (lambda: parts.qwen2_tokenizer(64), "AutoTokenizer"),
        (parts.clip_tokenizer, "CLIPTokenizer"),
        (parts.t5_tokenizer, "T5TokenizerFast"),
        (parts.byt5_tokenizer, "ByT5Tokenizer"),
    ],
)
def test_tokenizers_reload_as_the_pipeline_classes(make, loader, tmp_path):
    import transformers

    tokenizer = make()
    tokenizer.save_pretrained(tmp_path)
    loaded = getattr(transformers, loader).from_pretrained(tmp_path, local_files_only=True)
    ids = loaded(TEXT).input_ids
    assert ids == tokenizer(TEXT).input_ids
    assert len(ids) > 3 and max(ids) < parts.vocab_size(tokenizer)


def test_qwen_tokenizer_is_byte_level_with_the_chat_markers(tmp_path):
    tokenizer = parts.qwen2_tokenizer(64)
    ids = tokenizer(TEXT).input_ids
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    # one id per marker, one per byte of the rest ("user\na red bird" and the final newline)
    assert ids[0] == im_start and ids.count(im_end) == 1 and len(ids) == 2 + len("user\na red bird") + 1
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_cached_build_builds_once_and_atomically(tmp_path):
    calls: list[Path] = []

    def build(out: Path) -> None:
        calls.append(out)
        (out / "model_index.json").write_text("{}")

    final = tmp_path / "kind" / "name_key"
    assert cache.cached_build(final, build) == final
    assert cache.cached_build(final, build) == final
    assert len(calls) == 1 and calls[0] != final and not calls[0].exists()
    assert sorted(p.name for p in final.parent.iterdir()) == ["name_key"]


def test_failed_build_leaves_nothing(tmp_path):
    def build(out: Path) -> None:
        (out / "model_index.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        cache.cached_build(tmp_path / "kind" / "name_key", build)
    assert list((tmp_path / "kind").iterdir()) == []


def test_content_key_follows_spec_and_library_versions(monkeypatch):
    key = cache.content_key({"a": 1})
    assert key == cache.content_key({"a": 1}) and len(key) == 16
    assert cache.content_key({"a": 2}) != key
    monkeypatch.setattr(cache, "library_versions", lambda: {"torch": "0.0"})
    assert cache.content_key({"a": 1}) != key
