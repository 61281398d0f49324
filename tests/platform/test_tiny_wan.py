"""The embedded tiny Wan2.2 pipelines: layout, dimensions, determinism, content-keyed atomic cache."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from omni_procs import omni_installed
from safetensors.torch import load_file

from vllm_omni_mxfp4 import envs
from vllm_omni_mxfp4_tiny import wan as tiny_wan

BLOCK_LINEARS = (
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out.0",
    "attn2.to_q",
    "attn2.to_k",
    "attn2.to_v",
    "attn2.to_out.0",
    "ffn.net.0.proj",
    "ffn.net.2",
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("tiny_wan_cache")
    return {experts: tiny_wan.build_tiny_wan(experts, cache_dir=root) for experts in (1, 2)}


def _weights(model_dir: Path, component: str) -> dict[str, torch.Tensor]:
    return load_file(model_dir / component / "diffusion_pytorch_model.safetensors")


def test_two_expert_layout(built: dict[int, Path]) -> None:
    model_dir = built[2]
    index = json.loads((model_dir / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["boundary_ratio"] == 0.875
    for component in ("transformer", "transformer_2", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert index[component][0] is not None, component
        assert (model_dir / component).is_dir(), component
    assert index["scheduler"][1] == "FlowMatchEulerDiscreteScheduler"


def test_single_expert_layout(built: dict[int, Path]) -> None:
    model_dir = built[1]
    index = json.loads((model_dir / "model_index.json").read_text())
    assert index.get("transformer_2", [None])[0] is None
    assert index.get("boundary_ratio") is None
    assert not (model_dir / "transformer_2").exists()
    assert model_dir != built[2]


def test_config_overrides_make_variants_without_touching_the_default() -> None:
    variant = tiny_wan.tiny_transformer_config(num_layers=3, image_dim=8)
    assert variant["num_layers"] == 3 and variant["image_dim"] == 8
    assert variant["ffn_dim"] == tiny_wan.TRANSFORMER_CONFIG["ffn_dim"]
    assert tiny_wan.tiny_transformer_config() == tiny_wan.TRANSFORMER_CONFIG
    assert "image_dim" not in tiny_wan.TRANSFORMER_CONFIG and tiny_wan.TRANSFORMER_CONFIG["num_layers"] == 2


def test_transformer_config_on_disk(built: dict[int, Path]) -> None:
    config = json.loads((built[2] / "transformer_2" / "config.json").read_text())
    assert config["_class_name"] == "WanTransformer3DModel"
    for key, value in tiny_wan.tiny_transformer_config().items():
        assert config[key] == value, key


def test_every_block_linear_is_dualscale_sized(built: dict[int, Path]) -> None:
    for component in ("transformer", "transformer_2"):
        weights = _weights(built[2], component)
        found = 0
        for name, tensor in weights.items():
            if (
                name.startswith("blocks.")
                and name.endswith(".weight")
                and any(f".{n}." in name for n in BLOCK_LINEARS)
            ):
                found += 1
                assert tensor.dtype == torch.bfloat16, name
                assert tensor.ndim == 2 and tensor.shape[0] % 512 == 0 and tensor.shape[1] % 512 == 0, (
                    name,
                    tuple(tensor.shape),
                )
        assert found == len(BLOCK_LINEARS) * tiny_wan.TRANSFORMER_CONFIG["num_layers"]


def test_weights_are_seeded(built: dict[int, Path], tmp_path: Path) -> None:
    again = tiny_wan.build_tiny_wan(1, cache_dir=tmp_path)
    first, second = _weights(built[1], "transformer"), _weights(again, "transformer")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    # The two experts are different networks, not copies.
    expert_1, expert_2 = _weights(built[2], "transformer"), _weights(built[2], "transformer_2")
    assert not torch.equal(expert_1["blocks.0.attn1.to_q.weight"], expert_2["blocks.0.attn1.to_q.weight"])
    assert torch.equal(expert_1["blocks.0.attn1.to_q.weight"], first["blocks.0.attn1.to_q.weight"])


def test_cache_is_reused_without_rebuilding(built: dict[int, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    def no_build(out_dir: Path, experts: int) -> None:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tiny_wan, "_build_into", no_build)
    assert tiny_wan.build_tiny_wan(2, cache_dir=built[2].parent.parent) == built[2]


def test_cache_key_follows_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    before = tiny_wan._content_key(2)
    assert tiny_wan._content_key(1) != before
    monkeypatch.setitem(tiny_wan.TRANSFORMER_CONFIG, "num_layers", 3)
    assert tiny_wan._content_key(2) != before


def test_cache_root_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without ``cache_dir`` the build lands under ``$VLLM_OMNI_MXFP4_CACHE`` (read when called)."""
    monkeypatch.setenv("VLLM_OMNI_MXFP4_CACHE", str(tmp_path / "elsewhere"))
    built = tiny_wan.build_tiny_wan(1)
    assert built.parent == tmp_path / "elsewhere" / "tiny_wan"
    assert (built / "model_index.json").is_file()
    monkeypatch.delenv("VLLM_OMNI_MXFP4_CACHE")
    assert envs.cache_dir() == Path.home() / ".cache" / "vllm-omni-mxfp4"


def test_interrupted_build_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def interrupted(out_dir: Path, experts: int) -> None:
        (out_dir / "transformer").mkdir()
        (out_dir / "model_index.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny_wan, "_build_into", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny_wan.build_tiny_wan(1, cache_dir=tmp_path)
    assert list((tmp_path / "tiny_wan").iterdir()) == []


def test_losing_a_concurrent_build_race_returns_the_winner(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real_build = tiny_wan._build_into
    final = tmp_path / "tiny_wan" / f"wan22_t2v_1e_{tiny_wan._content_key(1)}"

    def racing(out_dir: Path, experts: int) -> None:
        real_build(out_dir, experts)
        real_build(final, experts)  # another process renames its finished copy into place first

    monkeypatch.setattr(tiny_wan, "_build_into", racing)
    assert tiny_wan.build_tiny_wan(1, cache_dir=tmp_path) == final
    assert [p.name for p in (tmp_path / "tiny_wan").iterdir()] == [final.name]


def test_bad_expert_count() -> None:
    with pytest.raises(ValueError, match="experts must be 1 or 2"):
        tiny_wan.build_tiny_wan(3)


def test_diffusers_generates_frames_from_it(built: dict[int, Path]) -> None:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(built[2])
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(
        prompt="a cat walking on the grass",
        negative_prompt="blurry",
        height=16,
        width=16,
        num_frames=9,
        num_inference_steps=2,
        guidance_scale=5.0,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).frames
    assert frames.shape == (1, 9, 3, 16, 16)
    assert torch.isfinite(frames).all()
    assert frames.std() > 1e-3


@pytest.mark.omni
@pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed")
def test_omni_transformer_kwargs_fit_vllm_omni_constructor() -> None:
    import vllm_omni  # noqa: F401
    from vllm_omni.diffusion.models.wan2_2.wan2_2_transformer import WanTransformer3DModel

    kwargs = tiny_wan.omni_transformer_kwargs()
    assert "qk_norm" not in kwargs and kwargs["patch_size"] == (1, 2, 2)
    inspect.signature(WanTransformer3DModel).bind(**kwargs)
