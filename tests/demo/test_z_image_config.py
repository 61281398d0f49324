"""The demo's general plugin :mod:`vllm_omni_mxfp4_tiny.z_image_config`: vLLM-Omni's ``ZImagePipeline``
builds its transformer from ``transformer/config.json`` with it, and still ignores that file
without it (the watch that fails once upstream reads the config itself: then drop the plugin).

The pipelines are built for real in this process from the tiny Z-Image pipeline
(:mod:`vllm_omni_mxfp4_tiny.z_image`); only upstream's unfixed build of the default 6B
transformer is made on the meta device (12 GB of BF16 weights otherwise).
"""

from __future__ import annotations

import json
import shutil
import sys
from importlib.metadata import entry_points

import pytest
import torch

from tests.platform.omni_procs import omni_installed
from vllm_omni_mxfp4_tiny import z_image, z_image_config

pytestmark = [
    pytest.mark.omni,
    pytest.mark.skipif(not omni_installed(), reason="vllm / vllm-omni not installed"),
]

TINY = z_image.TRANSFORMER_CONFIG


@pytest.fixture(scope="module")
def tiny_model():
    return z_image.build_tiny_z_image()


def _pipeline(model, init=None):
    """vLLM-Omni's ``ZImagePipeline`` for ``model``, built by ``init`` (default: its ``__init__``)."""
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.models.z_image.pipeline_z_image import ZImagePipeline

    od_config = OmniDiffusionConfig(model=str(model), dtype=torch.bfloat16)
    pipeline = ZImagePipeline.__new__(ZImagePipeline)
    (init or ZImagePipeline.__init__)(pipeline, od_config=od_config)
    return pipeline


def test_registered_as_a_general_plugin_of_the_demo():
    values = {e.name: e.value for e in entry_points(group="vllm_omni.general_plugins")}
    assert values.get("z_image_transformer_config") == "vllm_omni_mxfp4_tiny.z_image_config:install"


def test_install_is_idempotent():
    from vllm_omni.diffusion.models.z_image.pipeline_z_image import ZImagePipeline

    assert z_image_config.install()
    wrapped = ZImagePipeline.__init__
    assert z_image_config.install()
    assert ZImagePipeline.__init__ is wrapped
    assert not getattr(wrapped.__wrapped__, z_image_config._MARK, False)


def test_install_changes_nothing_without_vllm_omnis_z_image(monkeypatch):
    monkeypatch.setitem(sys.modules, z_image_config.PIPELINE_MODULE, None)  # the import raises ImportError
    assert z_image_config.install() is False


def test_kwargs_are_the_configs_constructor_arguments(tiny_model):
    from vllm_omni.diffusion.models.z_image.z_image_transformer import ZImageTransformer2DModel

    kwargs = z_image_config.transformer_kwargs(tiny_model, ZImageTransformer2DModel)
    # the builder's config (patch sizes as the constructor's tuples) plus what diffusers writes
    # with its own defaults; _class_name, _diffusers_version and siglip_feat_dim are not arguments
    expected = {**TINY, "all_patch_size": (2,), "all_f_patch_size": (1,)}
    expected |= {"norm_eps": 1e-05, "qk_norm": True, "rope_theta": 256.0, "t_scale": 1000.0}
    assert kwargs == expected


def test_no_local_config_means_upstreams_build(tmp_path):
    from vllm_omni.diffusion.models.z_image.z_image_transformer import ZImageTransformer2DModel

    assert z_image_config.transformer_kwargs("Tongyi-MAI/Z-Image-Turbo", ZImageTransformer2DModel) == {}
    assert z_image_config.transformer_kwargs(None, ZImageTransformer2DModel) == {}
    assert z_image_config.transformer_kwargs(tmp_path, ZImageTransformer2DModel) == {}


@pytest.mark.parametrize(
    ("text", "found"), [("[768, 1]", "found a JSON list"), ('{"dim": 768,', "could not read")]
)
def test_a_config_that_is_not_a_json_object_is_named(tiny_model, tmp_path, text, found):
    from vllm_omni.diffusion.models.z_image.z_image_transformer import ZImageTransformer2DModel

    model = tmp_path / "model"
    shutil.copytree(
        tiny_model / "transformer", model / "transformer", ignore=shutil.ignore_patterns("*.safetensors")
    )
    config = model / "transformer" / "config.json"
    json.loads(config.read_text())  # valid before the edit
    config.write_text(text)
    with pytest.raises(ValueError, match="could not|found") as exc:
        z_image_config.transformer_kwargs(model, ZImageTransformer2DModel)
    message = str(exc.value)
    assert str(config) in message and "a JSON object" in message and found in message


def test_pipeline_builds_the_configs_transformer(vllm_env, tiny_model, caplog):
    z_image_config.install()
    with vllm_env.context(), caplog.at_level("INFO", logger=z_image_config.__name__):
        transformer = _pipeline(tiny_model).transformer
    assert (transformer.dim, transformer.n_heads, transformer.in_channels) == (768, 6, 16)
    assert (len(transformer.layers), len(transformer.noise_refiner), len(transformer.context_refiner)) == (
        1,
        1,
        1,
    )
    assert transformer.cap_embedder[1].weight.shape == (768, TINY["cap_feat_dim"])
    assert transformer.layers[0].feed_forward.w2.weight.shape == (768, 2048)
    assert "transformer/config.json (dim=768, n_layers=1, n_heads=6)" in caplog.text


def test_upstream_still_ignores_the_config(vllm_env, tiny_model, monkeypatch):
    """Without the plugin, vLLM-Omni builds the default 6B transformer whatever config.json says;
    once this fails, upstream reads the config: drop vllm_omni_mxfp4_tiny/z_image_config.py and
    its entry point in examples/demo/pyproject.toml."""
    from vllm_omni.diffusion.models.z_image import pipeline_z_image

    z_image_config.install()
    upstream_init = pipeline_z_image.ZImagePipeline.__init__.__wrapped__

    class OnMeta(pipeline_z_image.ZImageTransformer2DModel):
        def __init__(self, *args, **kwargs):
            with torch.device("meta"):
                super().__init__(*args, **kwargs)

    monkeypatch.setattr(pipeline_z_image, "ZImageTransformer2DModel", OnMeta)
    with vllm_env.context():
        transformer = _pipeline(tiny_model, upstream_init).transformer
    assert isinstance(transformer, OnMeta)
    assert (transformer.dim, len(transformer.layers)) == (3840, 30), (
        "upstream now reads transformer/config.json"
    )
