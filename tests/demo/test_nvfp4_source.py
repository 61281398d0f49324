"""The demo's NVFP4 source copy is built once per content and reused (its packing runs in tests/hooks)."""

from __future__ import annotations

import json
import shutil

from vllm_omni_mxfp4_tiny.nvfp4_source import cached_nvfp4_pipeline


def test_cached_copy_follows_the_source_content(tiny_dir, tmp_path):
    source = tmp_path / "wan"
    shutil.copytree(tiny_dir, source)
    cache = tmp_path / "cache"
    first = cached_nvfp4_pipeline(source, cache_dir=cache)
    config = json.loads((first / "transformer" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    marker = first / "transformer" / "diffusion_pytorch_model.safetensors"
    built = marker.stat().st_mtime_ns
    assert cached_nvfp4_pipeline(source, cache_dir=cache) == first  # reused, not rebuilt
    assert marker.stat().st_mtime_ns == built
    index = source / "model_index.json"
    index.write_text(index.read_text() + "\n")  # any change to any file of the source: another copy
    second = cached_nvfp4_pipeline(source, cache_dir=cache)
    assert second != first and (second / "model_index.json").read_text() == index.read_text()
    assert sorted(p.name for p in (cache / "nvfp4_sources").iterdir()) == sorted([first.name, second.name])
